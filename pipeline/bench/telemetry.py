"""``rlstream bench telemetry``: what recording and shipping spans costs a producer.

One producer runs continuously (environment ``guess`` answering at once, ``--concurrency``
episodes in flight: policy-bound, the most spans per second, so the worst case for telemetry) while
the process's tracer is switched between a real one (spans batched to
``<ns>.telemetry``) and the no-op one, in windows of ``--seconds`` ordered
off-on-on-off, so that a drift of the machine hits both alike. Switching the tracer of a
running producer keeps everything else equal: no recompilation, no new connections.

Figures: ``telemetry_overhead_measured`` (the headline), the process's CPU time per
trajectory (all its threads: the policy, the tracer's flush thread, librdkafka's threads
that compress and send the spans) with the tracer on over off, medians of the windows, with
the per-pair differences' range and standard error; ``tracer_cpu_share``, the tracer's own
CPU time as accounted (recording: spans shipped times the cost of one span measured in the
same run; flushing: the flush thread's CPU time) over the process's while it was on; and
the same question asked of throughput directly, trajectories/s with and without
(medians of the windows, ``throughput_overhead`` = 1 - on / off, with the per-pair ratios'
range and standard error: on a loaded machine the windows differ by several percent, so
this answers only to that resolution); spans per second and per trajectory.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from typing import Any

from pipeline.kafka.client import KafkaConfig
from pipeline.launch.cluster import Cluster
from pipeline.observe.shipping import kafka_tracer
from pipeline.observe.telemetry import NullTracer, Tracer, install, span
from pipeline.rollout.config import AdmissionConfig, EpisodeLimits, ProducerConfig
from pipeline.rollout.producer import RolloutProducer


def run(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    seconds = args.seconds or 10.0
    pairs = max(2, args.rounds)  # the documented figure: 6
    with cluster as kafka:
        return measure(kafka, seconds, pairs, args.concurrency or 256)


def span_cost_s(n: int = 200_000) -> float:
    """Seconds of one ``with span(name, track)`` of an installed tracer (recording only,
    the form of the most frequent spans: environment steps and policy turns), less the
    cost of the loop around it."""
    t = install(Tracer("bench-cost"))  # no Kafka: records, never ships
    batch = 1000  # about a second's worth, then taken away as the flush thread does
    try:
        spans = loop = 0.0
        for _ in range(n // batch):
            start = time.perf_counter()
            for _ in range(batch):
                with span("env_step", "slot-1"):
                    pass
            spans += time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(batch):
                pass
            loop += time.perf_counter() - start
            t.take()
        return max(0.0, spans - loop) / (n // batch * batch)
    finally:
        install(NullTracer())


def measure(kafka: KafkaConfig, seconds: float, pairs: int, concurrency: int) -> dict[str, Any]:
    from pipeline.kafka.topics import ensure_topics, namespace_topics

    ns = f"benchtelemetry{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka, namespace_topics(ns, ["guess"], 4))
    cfg = ProducerConfig(
        namespace=ns,
        env="guess",
        concurrency=concurrency,
        group_size=8,
        limits=EpisodeLimits(max_new_tokens=8),
        admission=AdmissionConfig(max_staleness=-1),
    )
    producer = RolloutProducer(cfg, kafka)
    tracer = kafka_tracer("bench-producer", kafka, ns)
    th = threading.Thread(target=producer.run, daemon=True)
    th.start()

    def done() -> int:
        return sum(producer.stats.finished.values())

    while producer.writer.sent < 2 * concurrency:  # warm-up: compiled and flowing
        time.sleep(0.05)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpu_per_traj: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, float] = {"off": 0.0, "on": 0.0}
    on_s = 0.0
    try:
        for i in range(pairs):
            for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                install(tracer if mode == "on" else NullTracer())
                n0, c0, t0 = done(), time.process_time(), time.perf_counter()
                time.sleep(seconds)
                n, c, t = done() - n0, time.process_time() - c0, time.perf_counter() - t0
                rates[mode].append(n / t)
                cpu_per_traj[mode].append(c / max(1, n))
                cpu[mode] += c
                on_s += t if mode == "on" else 0.0
                print(
                    f"pair {i + 1}/{pairs} telemetry {mode:3} {n / t:7.1f} traj/s "
                    f"{1e3 * c / max(1, n):6.2f} ms CPU/traj",
                    flush=True,
                )
    finally:
        install(NullTracer())
        producer.stop()
        th.join(120)
        tracer.close()
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    pair_ratios = [a / b for a, b in zip(rates["on"], rates["off"], strict=True)]
    # the measurement: CPU time of the whole process (every thread: the policy, the
    # tracer's flush thread, librdkafka's compressing and sending) per trajectory
    cpu_on, cpu_off = statistics.median(cpu_per_traj["on"]), statistics.median(cpu_per_traj["off"])
    cpu_pairs = [a / b - 1 for a, b in zip(cpu_per_traj["on"], cpu_per_traj["off"], strict=True)]
    spans_per_s = tracer.spans_sent / on_s
    record_cpu = tracer.spans_sent * span_cost_s()
    return {
        "bench": "telemetry",
        "figures": {
            # measured: the process's CPU time per trajectory with the tracer on over off
            "telemetry_overhead_measured": cpu_on / cpu_off - 1,
            "cpu_per_trajectory_ms_on": 1e3 * cpu_on,
            "cpu_per_trajectory_ms_off": 1e3 * cpu_off,
            # the same from each pair alone (a drift of the machine cancels within a pair)
            "overhead_pair_median": statistics.median(cpu_pairs),
            "overhead_pair_mean": statistics.fmean(cpu_pairs),
            "overhead_pair_min": min(cpu_pairs),
            "overhead_pair_max": max(cpu_pairs),
            "overhead_pair_stderr": statistics.stdev(cpu_pairs) / len(cpu_pairs) ** 0.5,
            # accounted: the tracer's own CPU time over the process's while it was on
            # (spans times the cost of one, plus the flush thread; not librdkafka's)
            "tracer_cpu_share": (record_cpu + tracer.flush_cpu_s) / max(1e-9, cpu["on"]),
            "record_cpu_share": record_cpu / max(1e-9, cpu["on"]),
            "flush_cpu_share": tracer.flush_cpu_s / max(1e-9, cpu["on"]),
            "trajectories_per_s_off": off,
            "trajectories_per_s_on": on,
            # the same question asked of throughput directly: as noisy as the windows
            "throughput_overhead": 1 - on / off,
            "pair_ratio_min": min(pair_ratios),
            "pair_ratio_max": max(pair_ratios),
            "pair_ratio_stderr": statistics.stdev(pair_ratios) / len(pair_ratios) ** 0.5,
            "spans_per_s": spans_per_s,
            "spans_per_trajectory": spans_per_s / on if on else 0.0,
            "process_cpu_per_s": cpu["on"] / on_s,
            "windows_per_mode": pairs,
            "window_s": seconds,
            "concurrency": concurrency,
        },
        "ratios": {"on_vs_off": on / off},
        "goals": {"telemetry_overhead_measured": "<= 0.01"},
    }
