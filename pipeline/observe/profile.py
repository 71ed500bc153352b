"""``rlstream profile``: every process's spans from ``<ns>.telemetry`` on one timeline (a
Chrome trace / Perfetto JSON file, one track per process and per episode slot) and a
summary of where the time went.

The summary: the trainer's busy and idle shares (train spans over its wall time), each
producer's idle share (no policy forward running), the environment's share of episode
time, the time records spend in Kafka (produce to the trainer's read, p50/p99), weight
propagation per producer (the trainer's announcement to the producer's swap, p50/p99),
trajectories trained and dropped by reason.
"""

from __future__ import annotations

import json
import logging
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import confluent_kafka
import numpy as np

from pipeline.errors import RecordDecodeError, RlstreamError
from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import telemetry_topic
from pipeline.kafka.transport import read_ranges
from pipeline.records.codec import AvroCodec

log = logging.getLogger(__name__)

#: spans in which the trainer works (the rest of its wall time it waits for data)
TRAIN_SPANS = ("staleness_filter", "batch_assembly", "train_step", "checkpoint_save", "announce")
ENV_SPANS = ("env_reset", "env_step", "tool_call")


@dataclass
class Span:
    process: str
    name: str
    start_ns: int
    end_ns: int
    track: str
    attrs: Mapping[str, str]

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass
class Telemetry:
    spans: list[Span] = field(default_factory=list)
    metrics: list[tuple[str, str, int, float, Mapping[str, str]]] = field(default_factory=list)
    processes: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: telemetry records that did not decode (skipped, logged)
    undecodable: int = 0

    def add(self, batch: Mapping[str, Any]) -> None:
        p = batch["process"]
        self.processes.setdefault(p, {"host": batch["host"], "pid": batch["pid"]})
        for s in batch["spans"]:
            self.spans.append(
                Span(p, s["name"], s["start_ns"], s["end_ns"], s["track"], s["attributes"])
            )
        for m in batch["metrics"]:
            self.metrics.append((p, m["name"], m["time_ns"], m["value"], m["labels"]))


def read(kafka: KafkaConfig, namespace: str, timeout_s: float = 30.0) -> Telemetry:
    """Every telemetry batch of ``namespace`` up to the topic's end as of now."""
    topic = telemetry_topic(namespace)
    consumer = kafka.consumer(f"{namespace}.profile", **{"enable.partition.eof": False})
    out = Telemetry()
    codec = AvroCodec("Telemetry")
    try:
        md = consumer.list_topics(topic, timeout=10)
        if topic not in md.topics or md.topics[topic].error is not None:
            raise RlstreamError(f"namespace {namespace!r} has no telemetry topic {topic}")
        ranges = {
            (topic, p): consumer.get_watermark_offsets(
                confluent_kafka.TopicPartition(topic, p), timeout=10
            )
            for p in md.topics[topic].partitions
        }
        try:
            for m in read_ranges(consumer, ranges, timeout_s):
                try:
                    out.add(codec.decode(m.value or b""))
                except RecordDecodeError as e:  # one bad batch never hides the others
                    out.undecodable += 1
                    log.warning(
                        "telemetry record skipped partition=%d offset=%d reason=%s",
                        m.partition,
                        m.offset,
                        e.reason,
                    )
        except TimeoutError as e:
            raise RlstreamError(f"telemetry of {topic}: {e} in {timeout_s:g} s") from None
    finally:
        consumer.close()
    return out


def _union_s(intervals: list[tuple[int, int]]) -> float:
    """Seconds covered by the union of ``[start, end)`` nanosecond intervals."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None and cur_s is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None and cur_s is not None:
        total += cur_e - cur_s
    return total / 1e9


def _seconds(text: str) -> float:
    """An attribute that holds seconds: finite and not negative, else 0 (a hostile or
    broken record never turns a share into NaN)."""
    try:
        x = float(text)
    except ValueError:
        return 0.0
    return x if 0.0 <= x < float("inf") else 0.0


def _pct(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"count": 0}
    a = np.asarray(values)
    return {
        "count": len(values),
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
    }


def summarize(t: Telemetry) -> dict[str, Any]:
    by_proc: dict[str, list[Span]] = defaultdict(list)
    for s in t.spans:
        by_proc[s.process].append(s)
    trainers = [p for p, ss in by_proc.items() if any(s.name == "train_step" for s in ss)]
    # producers ship what they roll out (the run's own evaluation episodes do not count)
    producers = [p for p, ss in by_proc.items() if any(s.name == "produce" for s in ss)]
    out: dict[str, Any] = {"processes": sorted(by_proc), "spans": len(t.spans)}
    if t.undecodable:
        out["undecodable_records"] = t.undecodable

    def wall(ss: list[Span]) -> float:
        return (max(s.end_ns for s in ss) - min(s.start_ns for s in ss)) / 1e9

    busy = sum(
        _union_s([(s.start_ns, s.end_ns) for s in by_proc[p] if s.name in TRAIN_SPANS])
        for p in trainers
    )
    trainer_wall = sum(wall(by_proc[p]) for p in trainers)
    out["trainer_busy_share"] = busy / trainer_wall if trainer_wall else None
    out["trainer_idle_share"] = 1 - out["trainer_busy_share"] if trainer_wall else None
    out["producer_idle_share"] = {
        p: 1
        - _union_s([(s.start_ns, s.end_ns) for s in by_proc[p] if s.name == "policy_forward"])
        / max(1e-9, wall(by_proc[p]))
        for p in producers
    }
    episodes = [s for p in producers for s in by_proc[p] if s.name == "episode"]
    episode_s = sum(s.seconds for s in episodes)
    if all("env_s" in s.attrs for s in episodes):  # every episode's own account
        env_s = sum(_seconds(s.attrs["env_s"]) for s in episodes)
    else:  # telemetry of producers that recorded every environment call as a span
        env_s = sum(s.seconds for p in producers for s in by_proc[p] if s.name in ENV_SPANS)
    out["env_wait_share"] = env_s / episode_s if episode_s else None
    out["episodes"] = dict(
        Counter(s.attrs.get("status", "?") for s in t.spans if s.name == "episode")
    )
    out["kafka_latency_s"] = _pct([v for _, n, _, v, _ in t.metrics if n == "kafka_latency_s"])
    announced = {s.attrs.get("version"): s.end_ns for s in t.spans if s.name == "announce"}
    propagation: dict[str, list[float]] = defaultdict(list)
    for s in t.spans:
        if s.name == "weights_swap" and s.attrs.get("version") in announced:
            propagation[s.process].append((s.end_ns - announced[s.attrs["version"]]) / 1e9)
    out["weight_propagation_s"] = {p: _pct(v) for p, v in sorted(propagation.items())}
    out["trained"] = sum(int(s.attrs.get("trained", 0)) for s in t.spans if s.name == "train_step")
    out["steps"] = sum(1 for s in t.spans if s.name == "train_step")
    drops: Counter[str] = Counter()
    for _, n, _, v, labels in t.metrics:
        if n == "drop":
            drops[labels.get("reason", "?")] += int(v)
    out["dropped"] = dict(drops)
    out["telemetry_dropped"] = {
        p: int(v) for p, n, _, v, _ in t.metrics if n == "telemetry_dropped"
    }
    return out


def chrome_trace(t: Telemetry) -> dict[str, Any]:
    """The Chrome trace event format (also read by Perfetto): one process per emitting
    process, one thread per track; timestamps in microseconds since the first span."""
    if not t.spans:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = min(s.start_ns for s in t.spans)
    pids = {p: i + 1 for i, p in enumerate(sorted(t.processes))}
    tids: dict[tuple[str, str], int] = {}
    events: list[dict[str, Any]] = []
    for p, pid in pids.items():
        events.append(
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": p}}
        )
    for s in sorted(t.spans, key=lambda s: (s.process, s.track)):
        key = (s.process, s.track or "main")
        if key not in tids:
            tids[key] = len([k for k in tids if k[0] == s.process]) + 1
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pids[s.process],
                    "tid": tids[key],
                    "args": {"name": key[1]},
                }
            )
        events.append(
            {
                "ph": "X",
                "name": s.name,
                "pid": pids[s.process],
                "tid": tids[key],
                "ts": (s.start_ns - origin) / 1000,
                "dur": max(0.0, (s.end_ns - s.start_ns) / 1000),
                "args": dict(s.attrs),
            }
        )
    for p, name, time_ns, value, _ in t.metrics:
        if name in ("drop", "kafka_latency_s"):
            continue  # per-record samples: in the summary, not as counters
        events.append(
            {
                "ph": "C",
                "name": name,
                "pid": pids[p],
                "ts": (time_ns - origin) / 1000,
                "args": {"value": value},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(t: Telemetry, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(t)))


def render(summary: Mapping[str, Any], busy: bool = True) -> str:
    """The summary as text; ``busy=False`` leaves out the trainer's busy share (a report
    states its own, over the steps after the first)."""

    def share(x: Any) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    def pct(d: Mapping[str, Any]) -> str:
        if not d.get("count"):
            return "n/a"
        return f"p50 {d['p50'] * 1000:.1f} ms, p99 {d['p99'] * 1000:.1f} ms ({d['count']})"

    lines = [f"processes: {', '.join(summary['processes'])} ({summary['spans']} spans)"]
    if busy:
        lines.append(
            f"trainer busy {share(summary['trainer_busy_share'])}, "
            f"idle {share(summary['trainer_idle_share'])}"
        )
    for p, v in summary["producer_idle_share"].items():
        lines.append(f"producer {p} idle {share(v)} (no policy forward running)")
    lines.append(f"environment wait: {share(summary['env_wait_share'])} of episode time")
    lines.append(f"time in Kafka: {pct(summary['kafka_latency_s'])}")
    for p, d in summary["weight_propagation_s"].items():
        lines.append(f"weight propagation to {p}: {pct(d)}")
    lines.append(
        f"trained {summary['trained']} trajectories in {summary['steps']} steps; dropped "
        + (", ".join(f"{k} {v}" for k, v in sorted(summary["dropped"].items())) or "none")
    )
    return "\n".join(lines)
