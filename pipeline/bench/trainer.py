"""``rlstream bench trainer``: what the data path costs next to the train step.

Producers first fill a fresh namespace with real ``guess`` episodes (enough for every
step, so the trainer never waits); then a trainer with the default model and batch
(8 groups of 8) trains ``--steps`` steps from it. Per step, the data path (consume,
staleness filter, decode, group buffering, batch assembly) is compared with the jitted
train step. Compilations are counted after the first three steps.
"""

from __future__ import annotations

import argparse
import tempfile
import uuid
from pathlib import Path
from typing import Any

from pipeline.kafka.topics import ensure_topics, namespace_topics
from pipeline.launch.cluster import Cluster
from pipeline.rollout.config import AdmissionConfig, EpisodeLimits, ProducerConfig
from pipeline.rollout.producer import RolloutProducer
from pipeline.train.config import TrainerConfig
from pipeline.train.trainer import Trainer

WARMUP_STEPS = 3


def run(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    steps = args.steps or 20
    with cluster as kafka, tempfile.TemporaryDirectory() as tmp:
        ns = f"benchtrainer{uuid.uuid4().hex[:8]}"
        ensure_topics(kafka, namespace_topics(ns, ["guess"], 4))
        rows = 64
        episodes = (WARMUP_STEPS + steps + 1) * rows
        print(f"producing {episodes} episodes ...", flush=True)
        RolloutProducer(
            ProducerConfig(
                namespace=ns,
                env="guess",
                concurrency=64,
                max_episodes=episodes,
                limits=EpisodeLimits(max_new_tokens=8),
                admission=AdmissionConfig(max_staleness=-1),
            ),
            kafka,
        ).run()
        cfg = TrainerConfig(
            namespace=ns,
            run_dir=Path(tmp),
            max_staleness=10**6,
            max_steps=WARMUP_STEPS + steps,
            publish_every=10**6,
        )
        snapshot: dict[str, Any] = {}

        def on_step(m: dict[str, Any]) -> None:
            if m["step"] == WARMUP_STEPS:
                snapshot.update(trainer.timers, compiled=trainer.train_step._cache_size())

        trainer = Trainer(cfg, kafka, on_step=on_step)
        trainer.run()
    timers = {k: v - snapshot.get(k, 0.0) for k, v in trainer.timers.items()}
    n = steps
    data = timers.get("consume", 0.0) + timers.get("intake", 0.0) + timers.get("assemble", 0.0)
    step_s = timers["step"]
    return {
        "bench": "trainer",
        "figures": {
            "steps": n,
            "step_ms": 1000 * step_s / n,
            "data_ms_per_step": 1000 * data / n,
            "decode_filter_ms_per_step": 1000 * timers.get("intake", 0.0) / n,
            "assemble_ms_per_step": 1000 * timers.get("assemble", 0.0) / n,
            "kafka_consume_ms_per_step": 1000 * timers.get("consume", 0.0) / n,
            "data_overhead_fraction": data / step_s,
            "recompiles_after_warmup": trainer.train_step._cache_size() - snapshot["compiled"],
            "checkpoint_ms_per_step": 1000 * timers.get("checkpoint", 0.0) / n,
        },
        "ratios": {},
        "goals": {"data_overhead_fraction": "<= 0.05", "recompiles_after_warmup": "== 0"},
    }
