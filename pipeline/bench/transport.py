"""``rlstream bench transport``: trajectories through the broker, next to Kafka's tools.

In one run, on the same broker, the same records and record count, ``--rounds`` rounds
interleaved (each on new topics), medians:

- rlstream: encode + produce (idempotent, ``acks=all``, lz4) of N trajectories, then a
  consumer group reads and decodes all N;
- Kafka's own ``ProducerPerformance`` with the same producer settings and rlstream's
  encoded records as its payloads (``--payload-file``; the tool reads text, so each byte
  keeps its low 7 bits), and ``ConsumerPerformance`` with rlstream's consumer's fetch
  settings (``--consumer.config``).

Both consume timers run from the partition's assignment to the last record (the first
fetch included, the group's join left out: ConsumerPerformance's ``fetch`` figures). Both
produce figures come as records/s and as MB/s on the wire: the topic's compressed log
bytes (Kafka's LogDirsCommand) over the produce time. Ratios are rlstream's rate over
the tool's, for producing and for consuming; the headline ``vs_kafka_tools`` is the
smaller of the two.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.kafka.client import MAX_MESSAGE_BYTES, KafkaConfig
from pipeline.kafka.java import ensure_jars, find_java, kafka_home
from pipeline.kafka.topics import TopicSpec, delete_topics, ensure_topics
from pipeline.kafka.transport import Decoded, TrajectoryReader, TrajectoryWriter
from pipeline.launch.cluster import Cluster
from pipeline.records.codec import TrajectoryCodec
from pipeline.testing import make_trajectory

ENV = "bench"
_PRODUCER_PERF = re.compile(r"(\d+) records sent, ([\d.]+) records/sec \(([\d.]+) MB/sec\)")


#: separates records in the payload file of ProducerPerformance (a regular expression to
#: Java's String.split; checked absent from every record)
DELIMITER = "~rlstream-record~"


#: rlstream's consumer settings that Kafka's Java consumer takes under the same names
JAVA_FETCH_SETTINGS = (
    "fetch.max.bytes",
    "max.partition.fetch.bytes",
    "isolation.level",
    "auto.offset.reset",
)


def run(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    with cluster as kafka:
        return _measure(kafka, args.records, args.tokens, max(1, args.rounds))


def _measure(kafka: KafkaConfig, n: int, tokens: int, rounds: int) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    # Pre-built trajectories (generation is not what is measured), encoded in the loop.
    rng = np.random.default_rng(0)
    pool = [make_trajectory(tokens, rng=rng, env=ENV, group_id=f"g{i}") for i in range(64)]
    codec = TrajectoryCodec()
    encoded = [codec.encode(t) for t in pool]
    record_size = len(encoded[0])
    work = Path(tempfile.mkdtemp(prefix="rlstream-bench-transport-"))
    payload = _payload_file(encoded, work / "payload.txt")
    fetch = work / "consumer.properties"  # rlstream's consumer's fetch settings, for Java
    ours = kafka.consumer_config(None)  # the same names mean the same in both clients
    fetch.write_text("".join(f"{k}={ours[k]}\n" for k in JAVA_FETCH_SETTINGS))
    rows: dict[str, list[float]] = {
        k: [] for k in ("ours_p", "ours_c", "tool_p", "tool_c", "ours_wire", "tool_wire")
    }
    start_share: list[float] = []
    got = 0
    try:
        for r in range(rounds):  # interleaved: a drift of the machine hits both alike
            ns = f"bench{run_id}r{r}"
            ours_topic, tool_topic = f"{ns}.rollouts.{ENV}", f"{ns}.tools"
            size = {"max.message.bytes": str(MAX_MESSAGE_BYTES)}
            ensure_topics(kafka, [TopicSpec(t, 1, None, size) for t in (ours_topic, tool_topic)])
            produce_s = _produce(kafka, ns, pool, n)
            tool_p = _producer_perf(kafka, tool_topic, n, payload)
            got, consume_s, first_s = _consume(kafka, ours_topic, n, f"{ns}.reader")
            tool_c = _consumer_perf(kafka, tool_topic, n, fetch)
            wire = _log_bytes(kafka, [ours_topic, tool_topic])
            rows["ours_p"].append(n / produce_s)
            rows["ours_c"].append(got / consume_s)
            rows["tool_p"].append(tool_p)
            rows["tool_c"].append(tool_c)
            rows["ours_wire"].append(wire[ours_topic] / 1e6 / produce_s)
            rows["tool_wire"].append(wire[tool_topic] / 1e6 / (n / tool_p))
            start_share.append(first_s / consume_s)
            print(
                f"round {r + 1}/{rounds}: produce {n / produce_s:,.0f}/s (tool {tool_p:,.0f}/s), "
                f"consume {got / consume_s:,.0f}/s (tool {tool_c:,.0f}/s)",
                flush=True,
            )
            delete_topics(kafka, [ours_topic, tool_topic])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    m = {k: statistics.median(v) for k, v in rows.items()}
    mb = record_size / 1e6
    return {
        "bench": "transport",
        "figures": {
            "records": n,
            "rounds": rounds,
            "record_bytes": record_size,
            "rlstream_produce_per_s": m["ours_p"],
            "rlstream_produce_mb_per_s": m["ours_p"] * mb,
            "rlstream_produce_wire_mb_per_s": m["ours_wire"],
            "rlstream_consume_decode_per_s": m["ours_c"],
            "rlstream_consume_mb_per_s": m["ours_c"] * mb,
            "kafka_producer_perf_per_s": m["tool_p"],
            "kafka_producer_perf_mb_per_s": m["tool_p"] * mb,
            "kafka_producer_perf_wire_mb_per_s": m["tool_wire"],
            "kafka_consumer_perf_per_s": m["tool_c"],
            "kafka_consumer_perf_mb_per_s": m["tool_c"] * mb,
            # the first fetch's share of rlstream's consume time (its start-up)
            "rlstream_first_fetch_share": max(start_share),
            "consumed": got,
            "per_round": {k: [round(x, 1) for x in v] for k, v in rows.items()},
        },
        "ratios": {
            "produce_vs_kafka_tools": m["ours_p"] / m["tool_p"],
            "consume_vs_kafka_tools": m["ours_c"] / m["tool_c"],
            "vs_kafka_tools": min(m["ours_p"] / m["tool_p"], m["ours_c"] / m["tool_c"]),
        },
        "goals": {"vs_kafka_tools": ">= 0.5"},
    }


def _payload_file(encoded: list[bytes], path: Path) -> Path:
    """rlstream's encoded records as ProducerPerformance's payloads. The tool reads its
    payload file as UTF-8 text, so each byte keeps its low 7 bits (every record the same
    length, nearly the same content for lz4); the records are split at ``DELIMITER``."""
    texts = [bytes(b & 0x7F for b in e).decode("ascii") for e in encoded]
    if any(DELIMITER in t for t in texts):
        raise RuntimeError("the payload delimiter occurs in a record")
    path.write_text(DELIMITER.join(texts), encoding="ascii")
    return path


def _produce(kafka: KafkaConfig, ns: str, pool: list[Any], n: int) -> float:
    writer = TrajectoryWriter(kafka, ns)
    start = time.perf_counter()
    for i in range(n):
        writer.write(pool[i % len(pool)])
    writer.flush()
    return time.perf_counter() - start


def _consume(kafka: KafkaConfig, topic: str, n: int, group: str) -> tuple[int, float, float]:
    """Records read and decoded, seconds from the assignment (as ConsumerPerformance's
    ``fetch`` figures, which leave out the group's join) to the last record, and seconds to
    the first."""
    reader = TrajectoryReader(kafka, [topic], group)
    assigned: list[float] = []
    reader.consumer.subscribe([topic], on_assign=lambda c, ps: assigned.append(time.perf_counter()))
    got, first = 0, None
    deadline = time.monotonic() + 300
    while got < n and time.monotonic() < deadline:
        batch = reader.poll_batch(1024)
        if batch and first is None:
            first = time.perf_counter()
        got += sum(isinstance(r, Decoded) for r in batch)
    end = time.perf_counter()
    reader.close()
    begin = assigned[0] if assigned else end
    return got, end - begin, (first or end) - begin


def _log_bytes(kafka: KafkaConfig, topics: list[str]) -> dict[str, int]:
    """Bytes of each topic's log on the brokers (compressed batches, as on the wire), by
    Kafka's own LogDirsCommand; a partition replicated on several brokers counted once."""
    out = _java_tool(
        "org.apache.kafka.tools.LogDirsCommand",
        "--bootstrap-server",
        kafka.bootstrap,
        "--describe",
        "--topic-list",
        ",".join(topics),
    )
    doc = json.loads(next(ln for ln in reversed(out.splitlines()) if ln.startswith("{")))
    sizes: dict[str, int] = {}
    for broker in doc["brokers"]:
        for d in broker["logDirs"]:
            for part in d.get("partitions", []):
                sizes[part["partition"]] = max(sizes.get(part["partition"], 0), part["size"])
    return {t: sum(v for k, v in sizes.items() if k.rpartition("-")[0] == t) for t in topics}


def _java_tool(main_class: str, *tool_args: str) -> str:
    java, home = find_java(), kafka_home()
    lib = ensure_jars(home)
    logs = Path("/tmp") / f"rlstream-bench-{uuid.uuid4().hex[:6]}"
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [
        java,
        # the producer's buffer.memory (512 MiB) and room besides: a 512 MiB heap ran out
        "-Xmx1536m",
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


def _producer_perf(kafka: KafkaConfig, topic: str, n: int, payload: Path) -> float:
    """ProducerPerformance's records/s, with rlstream's records as payloads and
    rlstream's producer settings."""
    out = _java_tool(
        "org.apache.kafka.tools.ProducerPerformance",
        "--topic",
        topic,
        "--num-records",
        str(n),
        "--payload-file",
        str(payload),
        "--payload-delimiter",
        DELIMITER,
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
    return float(matches[-1][1])


def _consumer_perf(kafka: KafkaConfig, topic: str, n: int, config: Path) -> float:
    """ConsumerPerformance's records/s from its assignment to its last record (its
    ``fetch`` figure: the group's join left out), with rlstream's fetch settings."""
    out = _java_tool(
        "org.apache.kafka.tools.ConsumerPerformance",
        "--bootstrap-server",
        kafka.bootstrap,
        "--topic",
        topic,
        "--messages",
        str(n),
        "--consumer.config",
        str(config),
        "--timeout",
        "120000",
    )
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    header = [h.strip() for h in lines[-2].split(",")]
    values = [v.strip() for v in lines[-1].split(",")]
    row = dict(zip(header, values, strict=False))
    return float(row["fetch.nMsg.sec"])
