"""``rlstream bench transport``: trajectories through the broker, next to Kafka's tools.

In one run, on the same broker, record size and record count:

- rlstream: encode + produce (idempotent, ``acks=all``, lz4) of N trajectories, then a
  consumer group reads and decodes all N;
- Kafka's own ``ProducerPerformance`` and ``ConsumerPerformance`` (from kafka-tools) with
  the same producer settings.

Ratios are rlstream's rate over the tool's, for producing and for consuming; the
headline ``vs_kafka_tools`` is the smaller of the two.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.kafka.client import MAX_MESSAGE_BYTES, KafkaConfig
from pipeline.kafka.java import ensure_jars, find_java, kafka_home
from pipeline.kafka.topics import TopicSpec, ensure_topics
from pipeline.kafka.transport import Decoded, TrajectoryReader, TrajectoryWriter
from pipeline.launch.cluster import Cluster
from pipeline.records.codec import TrajectoryCodec
from pipeline.testing import make_trajectory

ENV = "bench"
_PRODUCER_PERF = re.compile(r"(\d+) records sent, ([\d.]+) records/sec \(([\d.]+) MB/sec\)")


def run(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    with cluster as kafka:
        return _measure(kafka, args.records, args.tokens)


def _measure(kafka: KafkaConfig, n: int, tokens: int) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    ns = f"bench{run_id}"
    ours_topic, tool_topic = f"{ns}.rollouts.{ENV}", f"{ns}.tools"
    size = {"max.message.bytes": str(MAX_MESSAGE_BYTES)}
    ensure_topics(kafka, [TopicSpec(t, 1, None, size) for t in (ours_topic, tool_topic)])

    # Pre-built trajectories (generation is not what is measured), encoded in the loop.
    rng = np.random.default_rng(0)
    pool = [make_trajectory(tokens, rng=rng, env=ENV, group_id=f"g{i}") for i in range(64)]
    record_size = len(TrajectoryCodec().encode(pool[0]))

    writer = TrajectoryWriter(kafka, ns)
    start = time.perf_counter()
    for i in range(n):
        writer.write(pool[i % len(pool)])
    writer.flush()
    produce_s = time.perf_counter() - start

    reader = TrajectoryReader(kafka, [ours_topic], f"{ns}.reader")
    got, first = 0, None
    deadline = time.monotonic() + 300
    while got < n and time.monotonic() < deadline:
        batch = reader.poll_batch(1024)
        if batch and first is None:
            first = time.perf_counter()
        got += sum(isinstance(r, Decoded) for r in batch)
    consume_s = time.perf_counter() - (first or time.perf_counter())
    reader.close()

    tool_produce = _producer_perf(kafka, tool_topic, n, record_size)
    tool_consume = _consumer_perf(kafka, tool_topic, n)

    mb = n * record_size / 1e6
    ours_p, ours_c = n / produce_s, got / consume_s
    return {
        "bench": "transport",
        "figures": {
            "records": n,
            "record_bytes": record_size,
            "rlstream_produce_per_s": ours_p,
            "rlstream_produce_mb_per_s": mb / produce_s,
            "rlstream_consume_decode_per_s": ours_c,
            "rlstream_consume_mb_per_s": got * record_size / 1e6 / consume_s,
            "kafka_producer_perf_per_s": tool_produce["per_s"],
            "kafka_producer_perf_mb_per_s": tool_produce["mb_per_s"],
            "kafka_consumer_perf_per_s": tool_consume["per_s"],
            "kafka_consumer_perf_mb_per_s": tool_consume["mb_per_s"],
            "consumed": got,
        },
        "ratios": {
            "produce_vs_kafka_tools": ours_p / tool_produce["per_s"],
            "consume_vs_kafka_tools": ours_c / tool_consume["per_s"],
            "vs_kafka_tools": min(ours_p / tool_produce["per_s"], ours_c / tool_consume["per_s"]),
        },
        "goals": {"vs_kafka_tools": ">= 0.5"},
    }


def _java_tool(main_class: str, *tool_args: str) -> str:
    java, home = find_java(), kafka_home()
    lib = ensure_jars(home)
    logs = Path("/tmp") / f"rlstream-bench-{uuid.uuid4().hex[:6]}"
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [
        java,
        "-Xmx512m",
        f"-Dkafka.logs.dir={logs}",
        f"-Dlog4j2.configurationFile={home / 'log4j2.properties'}",
        "-cp",
        str(lib / "*"),
        main_class,
        *tool_args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{main_class} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


def _producer_perf(kafka: KafkaConfig, topic: str, n: int, size: int) -> dict[str, float]:
    out = _java_tool(
        "org.apache.kafka.tools.ProducerPerformance",
        "--topic",
        topic,
        "--num-records",
        str(n),
        "--record-size",
        str(size),
        "--throughput",
        "-1",
        "--producer-props",
        f"bootstrap.servers={kafka.bootstrap}",
        "acks=all",
        "enable.idempotence=true",
        "compression.type=lz4",
        "linger.ms=5",
        f"batch.size={MAX_MESSAGE_BYTES}",
        "buffer.memory=536870912",
        f"max.request.size={MAX_MESSAGE_BYTES}",
    )
    matches = _PRODUCER_PERF.findall(out)
    if not matches:
        raise RuntimeError(f"cannot read ProducerPerformance output:\n{out[-1000:]}")
    _, per_s, mb_per_s = matches[-1]
    return {"per_s": float(per_s), "mb_per_s": float(mb_per_s)}


def _consumer_perf(kafka: KafkaConfig, topic: str, n: int) -> dict[str, float]:
    out = _java_tool(
        "org.apache.kafka.tools.ConsumerPerformance",
        "--bootstrap-server",
        kafka.bootstrap,
        "--topic",
        topic,
        "--messages",
        str(n),
        "--timeout",
        "120000",
    )
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    header = [h.strip() for h in lines[-2].split(",")]
    values = [v.strip() for v in lines[-1].split(",")]
    row = dict(zip(header, values, strict=False))
    # fetch.* excludes the group join, as the rlstream side does.
    return {"per_s": float(row["fetch.nMsg.sec"]), "mb_per_s": float(row["fetch.MB.sec"])}
