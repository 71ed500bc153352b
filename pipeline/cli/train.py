"""``rlstream train``: one trainer process."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from pipeline import compile_cache
from pipeline.cli.common import (
    add_json_arg,
    add_kafka_args,
    add_telemetry_arg,
    kafka_config,
    print_result,
    run_process,
)
from pipeline.launch.stop import process_flag
from pipeline.settings import add_flags, resolve, write_file


def register(sub: Any) -> None:
    from pipeline.train.config import TrainerConfig

    p = sub.add_parser(
        "train",
        help="run a trainer: consume, filter, batch, train, publish",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--from-file",
        default=None,
        help="train from a recording (rlstream replay record) instead of Kafka: "
        "deterministic, nothing committed or announced",
    )
    add_flags(p, TrainerConfig)
    add_telemetry_arg(p)
    add_kafka_args(p)
    add_json_arg(p)
    p.set_defaults(func=cmd_train, settings=TrainerConfig)


def cmd_train(args: argparse.Namespace) -> int:
    stop = process_flag()  # a SIGTERM since the process began stops it once it runs
    from pipeline.train.config import TrainerConfig
    from pipeline.train.trainer import Trainer

    cfg = resolve(TrainerConfig, args)
    if cfg.members == 1:  # (a trainer group compiles its collectives afresh)
        compile_cache.enable()
    source = None
    if args.from_file:
        from pipeline.kafka.replay import RecordingSource

        source = RecordingSource(
            Path(args.from_file), cfg.member_index, cfg.members, cfg.groups_per_batch
        )
        print(f"training from {args.from_file}: {len(source)} records", flush=True)
    start = time.monotonic()

    first_step: list[int] = []

    def progress(m: dict[str, Any]) -> None:
        first_step.append(m["step"])
        done = m["step"] - first_step[0] + 1
        reward = " ".join(f"{e}={r:.3f}" for e, r in m["reward"].items())
        print(
            f"step={m['step']} version={m['version']} reward[{reward}] loss={m['loss']:.4f} "
            f"staleness={m['staleness_mean']:.2f} lag={m['lag']} "
            f"steps/s={done / max(1e-9, time.monotonic() - start):.2f} "
            f"busy={m['busy_share']:.2f} drops={sum(m['drops'].values())}",
            flush=True,
        )

    kafka = None if source else kafka_config(args)
    trainer = Trainer(cfg, kafka, on_step=progress, source=source)
    if trainer.members.lead:  # what rlstream report reads of a trainer started on its own
        from pipeline.observe import provenance

        write_file(cfg, cfg.run_dir / "trainer.json")
        provenance.write(cfg.run_dir)
    stop.install()  # again: joining a JAX job installs JAX's own SIGTERM handler
    metrics = (cfg.metrics_port, cfg.metrics_host)
    step = run_process(args, trainer, stop, kafka, cfg.namespace, cfg.trainer_id, metrics)
    result = {
        "figures": {
            "steps": step,
            "version": trainer.version,
            "drops": dict(trainer.drops),
            "deadlettered": trainer.deadlettered,
            "partial_groups": trainer.partial_groups,
        }
    }
    print_result(args, result, f"trainer {cfg.trainer_id} stopped at step {step}")
    return 0
