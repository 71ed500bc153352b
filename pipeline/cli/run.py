"""``rlstream run`` (the main job) and ``rlstream eval`` (held-out success of a policy)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.cli.common import (
    add_broker_args,
    add_env_option_arg,
    add_json_arg,
    add_kafka_args,
    cluster,
    env_default,
    kafka_config,
    pct,
    print_result,
)
from pipeline.launch.stop import process_flag
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
        help="experiment namespace (env RLSTREAM_NAMESPACE; neither given: a new one per run)",
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
        "report",
        help="the report, plots and held-out evaluation of a run directory (one rlstream run "
        "wrote, or a trainer started on its own)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("run_dir", type=Path, help="the run directory (runs/<name>, a --run-dir)")
    p.add_argument(
        "--env",
        default=None,
        help="environment of the held-out episodes (None: the one the run trained on)",
    )
    add_env_option_arg(p)
    p.add_argument(
        "--eval-episodes",
        type=int,
        default=None,
        help="held-out episodes per evaluation when the run has none (None: the run's "
        "setting, 200 for a trainer alone; 0: no evaluation)",
    )
    add_kafka_args(p)
    add_json_arg(p)
    p.set_defaults(func=cmd_report)

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
    stop = process_flag()
    with cluster(args) as kafka:
        result = Run(cfg, kafka, run_dir, namespace, stop.event).execute()
    f = result.figures
    text = (
        f"run {result.status}: {f['steps']} steps in {f['wall_s']:.0f}s; "
        f"success on {cfg.eval_episodes} held-out episodes: initial "
        f"{pct(f['success_initial'])} -> final {pct(f['success_final'])}"
        + (
            f" ({f['gain_over_random_points']:+.1f} points over random answers "
            f"{pct(f['random_success'])})"
            if f.get("gain_over_random_points") is not None
            else ""
        )
        + "; "
        f"trained {f['trajectories_trained']} trajectories, dropped as stale "
        f"{f['trajectories_dropped_stale']}\nreport: {result.report}"
    )
    print_result(args, {"status": result.status, "run_dir": str(run_dir), "figures": f}, text)
    if result.status == "failed":
        return 1
    return 130 if result.status == "interrupted" else 0


def cmd_report(args: argparse.Namespace) -> int:
    from pipeline.errors import RlstreamError
    from pipeline.launch.cluster import checked
    from pipeline.launch.report import build_report, run_info, subject
    from pipeline.settings import parse_item

    options = dict(parse_item(item) for item in args.env_option) if args.env_option else None
    subject(args.run_dir, args.env, options, args.eval_episodes)  # refused before connecting
    kafka, no_kafka = None, ""
    bootstrap = args.bootstrap or run_info(args.run_dir).get("bootstrap")  # the run's cluster
    wanted = kafka_config(args, bootstrap, check=False)
    try:
        kafka = checked(wanted)
    except RlstreamError as e:
        no_kafka = f"Kafka at {wanted.bootstrap} did not answer"
        print(
            f"rlstream: warning: no sample episodes and no profile in the report: {e}",
            file=sys.stderr,
        )
    figures, path = build_report(
        args.run_dir,
        kafka,
        env=args.env,
        env_options=options,
        eval_episodes=args.eval_episodes,
        say=lambda text: print(text, flush=True),
        no_kafka=no_kafka,
    )
    print_result(
        args,
        {"run_dir": str(args.run_dir), "report": str(path), "figures": figures},
        f"report: {path} (plots in {path.parent / 'plots'})",
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from pipeline.rollout.config import EvalConfig
    from pipeline.rollout.evaluate import evaluate_weights

    cfg = resolve(EvalConfig, args)
    r = evaluate_weights(
        cfg.env,
        env_options=cfg.env_options,
        tools=cfg.tools,
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
