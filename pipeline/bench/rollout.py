"""``rlstream bench rollout``: trajectories/s of one producer at concurrency 1, 8 and 64.

The environment (``guess``) answers with a heavy-tailed latency (log-normal, median
50 ms). With one episode in flight the producer mostly waits; with many, the waiting
overlaps and policy turns are batched. Every trajectory goes through Kafka as in
production. Each concurrency runs for ``--seconds`` after a warm-up (compilation).
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from typing import Any

from connectors.base import LatencyModel
from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import ensure_topics, namespace_topics
from pipeline.launch.cluster import Cluster
from pipeline.rollout.config import AdmissionConfig, EpisodeLimits, ProducerConfig
from pipeline.rollout.producer import RolloutProducer

LEVELS = (1, 8, 64)


def run(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    with cluster as kafka:
        seconds = args.seconds or 15.0
        latency_ms = 50.0 if args.latency_ms is None else args.latency_ms
        rates = {c: measure(kafka, c, seconds, latency_ms / 1000) for c in LEVELS}
    figures: dict[str, Any] = {f"trajectories_per_s_c{c}": r for c, r in rates.items()}
    figures["latency_median_ms"] = latency_ms
    return {
        "bench": "rollout",
        "figures": figures,
        "ratios": {
            "concurrency_8_vs_1": rates[8] / rates[1],
            "concurrency_64_vs_1": rates[64] / rates[1],
        },
        "goals": {"concurrency_64_vs_1": ">= 20"},
    }


def measure(kafka: KafkaConfig, concurrency: int, seconds: float, median_s: float) -> float:
    ns = f"benchrollout{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka, namespace_topics(ns, ["guess"], 4))
    cfg = ProducerConfig(
        namespace=ns,
        env="guess",
        env_options={"latency": LatencyModel(median_s, 1.0)},
        concurrency=concurrency,
        group_size=min(8, concurrency),
        limits=EpisodeLimits(max_new_tokens=8),
        admission=AdmissionConfig(max_staleness=-1),
    )
    producer = RolloutProducer(cfg, kafka)
    th = threading.Thread(target=producer.run, daemon=True)
    th.start()
    while producer.writer.sent < max(2, concurrency // 2):  # warm-up: compiled and flowing
        time.sleep(0.05)
    start_n, start = producer.writer.sent, time.perf_counter()
    time.sleep(seconds)
    n, elapsed = producer.writer.sent - start_n, time.perf_counter() - start
    producer.stop()
    th.join(120)
    print(
        f"concurrency={concurrency} trajectories={n} seconds={elapsed:.1f} "
        f"rate={n / elapsed:.1f}/s",
        flush=True,
    )
    return n / elapsed
