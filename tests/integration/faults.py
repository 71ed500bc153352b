"""Helpers of the fault-injection suite: a trainer and producers as separate OS processes
against one cluster, and what the topics and the ledger say afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import confluent_kafka

from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import rollout_topic
from pipeline.kafka.transport import Decoded, TrajectoryReader
from pipeline.observe.report import read_jsonl
from pipeline.records.ledger import durable_ledger, outcomes, read_ledger

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", *args]


def terminate_as_it_starts(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """SIGTERM an ``rlstream`` process the moment it handles SIGTERM (read from
    /proc), and check that this moment came before it loaded numpy, the first of the
    libraries it needs seconds to load under load (JAX, ml_dtypes): a signal in that
    time must stop it cleanly once it runs, not kill it."""
    proc_dir = Path(f"/proc/{proc.pid}")
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "it never handled SIGTERM"
        try:
            ours = b"pipeline.cli" in (proc_dir / "cmdline").read_bytes()  # (exec'd)
            caught = next(
                line
                for line in (proc_dir / "status").read_text().splitlines()
                if line.startswith("SigCgt:")
            )
        except (OSError, StopIteration):
            ours = False
        if ours and int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)):
            break
        time.sleep(0.001)
    numpy_loaded = "numpy" in (proc_dir / "maps").read_text()
    proc.send_signal(signal.SIGTERM)
    assert not numpy_loaded, "its stop handler was installed only once numpy had loaded"


def guess_trainer(common: list[str], run_dir: Path, *flags: str) -> list[str]:
    """``rlstream train`` of the ``guess_producer``'s groups, four per step, publishing
    every step, with short group and batch timeouts (``flags`` add to it)."""
    return cli(
        "train",
        *common,
        "--run-dir",
        str(run_dir),
        "--groups-per-batch",
        "4",
        "--group-size",
        "4",
        "--publish-every",
        "1",
        "--group-timeout-s",
        "20",
        "--batch-timeout-s",
        "3",
        "--max-staleness",
        "3",
        *flags,
    )


def guess_producer(common: list[str], episodes: int, *flags: str) -> list[str]:
    """``rlstream produce`` of ``episodes`` short ``guess`` episodes in groups of four, 16
    at a time (``flags`` add to it, e.g. its admission settings)."""
    return cli(
        "produce",
        *common,
        "--env",
        "guess",
        "--concurrency",
        "16",
        "--group-size",
        "4",
        "--max-episodes",
        str(episodes),
        "--max-new-tokens",
        "4",
        *flags,
    )


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.5)


class Pipeline:
    """``rlstream train`` and ``rlstream produce`` processes of one namespace, with their
    logs, status files and metrics in ``run_dir``."""

    def __init__(
        self, bootstrap: str, namespace: str, run_dir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.bootstrap, self.namespace, self.run_dir = bootstrap, namespace, run_dir
        self.env = {**os.environ, **(env or {})}
        self.procs: list[subprocess.Popen[str]] = []
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "producers").mkdir(exist_ok=True)

    def _start(self, name: str, args: list[str]) -> subprocess.Popen[str]:
        log = (self.run_dir / "logs" / f"{name}.log").open("a")
        proc = subprocess.Popen(
            cli(*args, "--bootstrap", self.bootstrap, "--namespace", self.namespace),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=self.env,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def trainer(self, *extra: str) -> subprocess.Popen[str]:
        return self._start(
            "trainer",
            [
                "train",
                "--run-dir",
                str(self.run_dir),
                "--groups-per-batch",
                "2",
                "--group-size",
                "4",
                "--publish-every",
                "1",
                "--batch-timeout-s",
                "3",
                "--group-timeout-s",
                "60",
                *extra,
            ],
        )

    def producer(self, name: str, *extra: str) -> subprocess.Popen[str]:
        return self._start(
            name,
            [
                "produce",
                "--env",
                "guess",
                "--producer-id",
                name,
                "--group-size",
                "4",
                "--max-new-tokens",
                "4",
                "--partitions",
                "2",
                "--checkpoint-root",
                str(self.run_dir),
                "--status-file",
                str(self.run_dir / "producers" / f"{name}.jsonl"),
                "--json",
                *extra,
            ],
        )

    def log(self, name: str) -> str:
        """The end of a process's log, less librdkafka's connection failures (a broker
        away for seconds writes hundreds)."""
        path = self.run_dir / "logs" / f"{name}.log"
        if not path.exists():
            return ""
        lines = [x for x in path.read_text().splitlines() if "Connect to ipv4" not in x]
        return "\n".join(lines)[-3000:]

    def steps(self) -> list[dict[str, Any]]:
        return read_jsonl(self.run_dir / "metrics.jsonl")

    def last_step(self) -> int:
        steps = self.steps()
        return steps[-1]["step"] if steps else 0

    def status(self, name: str) -> list[dict[str, Any]]:
        return read_jsonl(self.run_dir / "producers" / f"{name}.jsonl")

    def result(self, name: str) -> dict[str, Any]:
        """The producer's final JSON line (after it exited)."""
        lines = [ln for ln in self.log(name).splitlines() if ln.startswith("{")]
        assert lines, f"{name} printed no result:\n{self.log(name)}"
        return json.loads(lines[-1])

    def outcomes(self) -> dict[tuple[str, int, int], list[str]]:
        return outcomes(durable_ledger(self.run_dir))  # what a restart keeps

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def topic_records(
    kafka: KafkaConfig, namespace: str, env: str = "guess"
) -> dict[tuple[str, int, int], Decoded]:
    """Every record of the environment's rollout topic, decoded (a record that does not
    decode fails the test), by (topic, partition, offset)."""
    topic = rollout_topic(namespace, env)
    consumer = kafka.consumer(None)
    md = consumer.list_topics(topic, timeout=10)
    total = 0
    for p in md.topics[topic].partitions:
        low, high = consumer.get_watermark_offsets(
            confluent_kafka.TopicPartition(topic, p), timeout=10
        )
        total += high - low
    consumer.close()
    reader = TrajectoryReader(kafka, [topic], f"{namespace}.audit-{time.monotonic_ns()}")
    out: dict[tuple[str, int, int], Decoded] = {}
    try:
        for r in reader.read(total, timeout=120):
            assert isinstance(r, Decoded), f"a record in {topic} does not decode: {r}"
            out[(r.where.topic, r.where.partition, r.where.offset)] = r
    finally:
        reader.close()
    assert len(out) == total
    return out


def assert_exactly_once(
    pipeline: Pipeline, produced: dict[tuple[str, int, int], Decoded], timeout: float = 240
) -> dict[tuple[str, int, int], list[str]]:
    """Wait until the trainer has settled every produced record, then check that each was
    trained or dropped exactly once, and that no trajectory id was trained twice."""
    wait_for(
        lambda: set(pipeline.outcomes()) >= set(produced),
        timeout,
        f"the trainer to settle all {len(produced)} records\n{pipeline.log('trainer')}",
    )
    seen = pipeline.outcomes()
    twice = {k: v for k, v in seen.items() if len(v) > 1}
    assert not twice, f"settled more than once: {list(twice.items())[:5]}"
    ids = [t[0] for e in read_ledger(pipeline.run_dir / "ledger.jsonl") for t in e["trained"]]
    assert len(ids) == len(set(ids))
    return seen


def assert_delivered_once(
    pipeline: Pipeline, kafka: KafkaConfig, producer: str, episodes: int
) -> None:
    """The producer (exited) delivered all ``episodes`` without a failure; the topic holds
    each exactly once; the trainer settled each exactly once."""
    figures = pipeline.result(producer)["figures"]
    assert figures["delivery_failed"] == 0
    records = topic_records(kafka, pipeline.namespace)
    assert len(records) == figures["delivered"] == figures["sent"] == episodes
    ids = [r.trajectory.trajectory_id for r in records.values()]
    assert len(set(ids)) == len(ids)
    assert_exactly_once(pipeline, records)


class CommandLineWatch:
    """While active, reads every process's command line (``/proc/PID/cmdline``) every
    few milliseconds and keeps those that contain ``secret``."""

    def __init__(self, secret: str) -> None:
        self.secret = secret.encode()
        self.seen: list[bytes] = []
        self.scans = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CommandLineWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        line = f.read()
                except OSError:
                    continue
                if self.secret in line:
                    self.seen.append(line[:300])
            self.scans += 1
            time.sleep(0.002)
