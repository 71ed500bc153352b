"""``rlstream bench trainer``: what the data path costs next to the train step, and what
packing saves.

Producers first fill a fresh namespace with real ``guess`` episodes (enough for every
step, so the trainer never waits), and the records are copied byte for byte into a
second namespace. Then two trainers with the default model and batch (8 groups of 8)
train ``--steps`` steps each from the same records: one packing several trajectories per
row (the default), one with a trajectory per row padded to its length bucket. Per step,
the data path (consume, staleness filter, decode, group buffering, batch assembly) is
compared with the jitted train step; XLA compilations (of anything) are counted after the
first three steps; the padding fraction and the trajectory tokens trained per second of step time
are set side by side (``packed_vs_bucketed``).
"""

from __future__ import annotations

import argparse
import tempfile
import uuid
from pathlib import Path
from typing import Any

import jax

from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.replay import play, record
from pipeline.kafka.topics import ensure_topics, namespace_topics
from pipeline.launch.cluster import Cluster
from pipeline.rollout.config import AdmissionConfig, EpisodeLimits, ProducerConfig
from pipeline.rollout.producer import RolloutProducer
from pipeline.train.config import TrainerConfig
from pipeline.train.trainer import Trainer

WARMUP_STEPS = 3


def _train(kafka: KafkaConfig, ns: str, packing: bool, steps: int, run_dir: Path) -> dict[str, Any]:
    """One trainer's figures over ``steps`` steps after the warm-up steps."""
    cfg = TrainerConfig(
        namespace=ns,
        run_dir=run_dir,
        max_staleness=10**6,
        max_steps=WARMUP_STEPS + steps,
        publish_every=10**6,
        packing=packing,
    )
    snapshot: dict[str, Any] = {}
    tokens = [0, 0]  # trajectory tokens, batch tokens (after the warm-up steps)
    compiles = [0]

    def on_compile(event: str, duration_secs: float, **kwargs: str | int) -> None:
        compiles[0] += event == "/jax/core/compile/backend_compile_duration"

    jax.monitoring.register_event_duration_secs_listener(on_compile)

    def on_step(m: dict[str, Any]) -> None:
        if m["step"] == WARMUP_STEPS:
            snapshot.update(trainer.timers, compiled=compiles[0])
        elif m["step"] > WARMUP_STEPS:
            tokens[0] += m["sequence_tokens"]
            tokens[1] += m["rows"] * m["bucket"]

    print(f"training {'packed' if packing else 'bucketed'} ...", flush=True)
    trainer = Trainer(cfg, kafka, on_step=on_step)
    trainer.run()
    timers = {k: v - snapshot.get(k, 0.0) for k, v in trainer.timers.items()}
    n = steps
    data = timers.get("consume", 0.0) + timers.get("intake", 0.0) + timers.get("assemble", 0.0)
    step_s = timers["step"]
    return {
        "steps": n,
        "step_ms": 1000 * step_s / n,
        "data_ms_per_step": 1000 * data / n,
        "decode_filter_ms_per_step": 1000 * timers.get("intake", 0.0) / n,
        "assemble_ms_per_step": 1000 * timers.get("assemble", 0.0) / n,
        "kafka_consume_ms_per_step": 1000 * timers.get("consume", 0.0) / n,
        "data_overhead_fraction": data / step_s,
        "recompiles_after_warmup": compiles[0] - snapshot["compiled"],
        "checkpoint_ms_per_step": 1000 * timers.get("checkpoint", 0.0) / n,
        "padding_fraction": 1.0 - tokens[0] / max(1, tokens[1]),
        "trained_tokens_per_s": tokens[0] / step_s,
    }


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
        copy = Path(tmp) / "records.avro"
        record(kafka, ns, copy)
        play(copy, kafka, f"{ns}b")
        bucketed = _train(kafka, f"{ns}b", False, steps, Path(tmp) / "bucketed")
        packed = _train(kafka, ns, True, steps, Path(tmp) / "packed")
    figures = dict(packed)
    figures |= {
        "bucketed_step_ms": bucketed["step_ms"],
        "bucketed_padding_fraction": bucketed["padding_fraction"],
        "bucketed_trained_tokens_per_s": bucketed["trained_tokens_per_s"],
        "bucketed_recompiles_after_warmup": bucketed["recompiles_after_warmup"],
    }
    return {
        "bench": "trainer",
        "figures": figures,
        "ratios": {
            "packed_vs_bucketed": packed["trained_tokens_per_s"] / bucketed["trained_tokens_per_s"]
        },
        "goals": {
            "data_overhead_fraction": "<= 0.05",
            "recompiles_after_warmup": "== 0",
            "packed_vs_bucketed": ">= 1.5",
        },
    }
