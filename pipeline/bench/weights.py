"""``rlstream bench weights``: how fast a new checkpoint reaches a running producer, and
how long generation stalls for the swap.

A producer runs 64 episodes against ``guess`` (50 ms median latency) with weight reload
on; a publisher saves a checkpoint and announces it every ``--interval`` seconds. For
each announcement: propagation = the moment the policy thread first samples with the
new version minus the announcement's creation time (checkpoint already durable); swap
stall = the swap itself plus how much longer the first decode step after it took than
the median step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from connectors.base import LatencyModel
from pipeline.kafka.topics import ensure_topics, namespace_topics
from pipeline.kafka.weights import announce, announcement
from pipeline.launch.cluster import Cluster
from pipeline.policy.checkpoint import save_params
from pipeline.policy.config import ModelConfig
from pipeline.policy.model import init_model
from pipeline.policy.tokenizer import TOKENIZER_ID
from pipeline.rollout.config import AdmissionConfig, EpisodeLimits, ProducerConfig
from pipeline.rollout.producer import RolloutProducer


def run(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    with cluster as kafka, tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ns = f"benchweights{uuid.uuid4().hex[:8]}"
        ensure_topics(kafka, namespace_topics(ns, ["guess"], 4))
        cfg = ProducerConfig(
            namespace=ns,
            env="guess",
            env_options={"latency": LatencyModel(0.05, 1.0)},
            concurrency=64,
            limits=EpisodeLimits(max_new_tokens=8),
            checkpoint_roots=(root,),
            admission=AdmissionConfig(max_staleness=-1),
        )
        producer = RolloutProducer(cfg, kafka)
        th = threading.Thread(target=producer.run, daemon=True)
        th.start()
        while producer.writer.sent < 32:
            time.sleep(0.05)
        publisher = kafka.producer()
        created: dict[int, float] = {}
        model_cfg = ModelConfig()
        for version in range(1, args.announcements + 1):
            path = save_params(root / f"v{version}", init_model(model_cfg, seed=version))
            record = announcement(version, version, path, model_cfg, TOKENIZER_ID, "bench")
            created[version] = record["created_at_ms"] / 1000
            announce(publisher, ns, record)
            time.sleep(args.interval)
        deadline = time.monotonic() + 30
        while producer.version < args.announcements and time.monotonic() < deadline:
            time.sleep(0.1)
        producer.stop()
        th.join(120)
    server = producer.server
    median_step = statistics.median(server.step_s)
    propagation = [at - created[v] for v, at, _, _ in server.swaps if v in created]
    stalls = [swap_s + max(0.0, first - median_step) for _, _, swap_s, first in server.swaps]
    if not propagation:
        raise RuntimeError("no announcement reached the producer")
    return {
        "bench": "weights",
        "figures": {
            "announcements": args.announcements,
            "applied": len(propagation),
            "propagation_p50_s": float(np.percentile(propagation, 50)),
            "propagation_p99_s": float(np.percentile(propagation, 99)),
            "swap_stall_ms_p50": 1000 * float(np.percentile(stalls, 50)),
            "swap_stall_ms_max": 1000 * max(stalls),
            "decode_step_ms_p50": 1000 * median_step,
        },
        "ratios": {},
        "goals": {
            "propagation_p50_s": "< 1",
            "propagation_p99_s": "< 3",
            "swap_stall_ms_p50": "<= 50",
        },
    }
