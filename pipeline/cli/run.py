"""``rlstream run`` (the main job) and ``rlstream eval`` (held-out success of a policy)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from pipeline.cli.common import (
    add_broker_args,
    add_json_arg,
    add_kafka_args,
    cluster,
    env_default,
    pct,
    print_result,
)
from pipeline.launch.stop import StopFlag
from pipeline.settings import add_flags, resolve


def register(sub: Any) -> None:
    from pipeline.launch.config import RunConfig
    from pipeline.rollout.config import EvalConfig

    p = sub.add_parser(
        "run",
        help="the main job: the whole pipeline (trainer and producers as separate "
        "processes) with live progress, held-out evaluation and a report",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--namespace",
        default=env_default("RLSTREAM_NAMESPACE"),
        help="experiment namespace (env RLSTREAM_NAMESPACE; default: a new one per run)",
    )
    p.add_argument("--run-dir", default=None, help="default: runs/<namespace>")
    p.add_argument(
        "--restart-on-failure",
        action="store_true",
        help="restart a process that fails (up to 3 times) instead of stopping the run "
        "(sets restarts to 3)",
    )
    add_flags(p, RunConfig)
    add_kafka_args(p)
    add_broker_args(p)
    add_json_arg(p)
    p.set_defaults(func=cmd_run, settings=RunConfig)

    p = sub.add_parser(
        "eval",
        help="success of a policy on held-out episodes (no Kafka)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_flags(p, EvalConfig)
    add_json_arg(p)
    p.set_defaults(func=cmd_eval, settings=EvalConfig)


def cmd_run(args: argparse.Namespace) -> int:
    from pipeline.launch.config import RunConfig
    from pipeline.launch.run import Run

    if args.restart_on_failure:
        args.restarts = 3
    cfg = resolve(RunConfig, args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    namespace = args.namespace or f"run-{stamp}-{os.getpid() % 10000}"
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / namespace
    stop = StopFlag().install()
    with cluster(args) as kafka:
        result = Run(cfg, kafka, run_dir, namespace, stop.event).execute()
    f = result.figures
    text = (
        f"run {result.status}: {f['steps']} steps in {f['wall_s']:.0f}s; "
        f"success on {cfg.eval_episodes} held-out episodes: initial "
        f"{pct(f['success_initial'])} -> final {pct(f['success_final'])}; "
        f"trained {f['trajectories_trained']} trajectories, dropped as stale "
        f"{f['trajectories_dropped_stale']}\nreport: {result.report}"
    )
    print_result(args, {"status": result.status, "run_dir": str(run_dir), "figures": f}, text)
    if result.status == "failed":
        return 1
    return 130 if result.status == "interrupted" else 0


def cmd_eval(args: argparse.Namespace) -> int:
    from pipeline.rollout.config import EvalConfig
    from pipeline.rollout.evaluate import evaluate_weights

    cfg = resolve(EvalConfig, args)
    r = evaluate_weights(
        cfg.env,
        env_options=cfg.env_options,
        model=cfg.model,
        weights=cfg.weights,
        model_seed=cfg.model_seed,
        episodes=cfg.episodes,
        seed=cfg.seed,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
    )
    print_result(
        args,
        {"figures": r.to_json()},
        f"{cfg.weights or 'initial policy'}: success {pct(r.success)} "
        f"reward {r.reward_mean:.3f} on {r.episodes} held-out episodes of {cfg.env}",
    )
    return 0
