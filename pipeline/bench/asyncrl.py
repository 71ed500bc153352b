"""``rlstream bench async``: wall-clock time to the same number of trainer steps, the
asynchronous pipeline against the synchronous loop, in one run.

Both modes are ``rlstream run`` with the same components, model, batch and environment,
whose latency is heavy-tailed (log-normal; a batch of the synchronous loop waits for its
slowest episode). Time is measured between the trainer's first and last step (so process
start-up and compilation, equal in both, do not count); the trainer's busy share over the
same span. Both final policies are evaluated on the same held-out episodes: they were
trained on the same number of samples.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from pipeline.launch.cluster import Cluster
from pipeline.launch.config import RunConfig
from pipeline.launch.run import Run
from pipeline.launch.stop import process_flag
from pipeline.observe.report import busy_share, mean_over_envs, moving_mean, trainer_metrics

MODES = ("async", "sync")


def run(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(args.run_dir or f"runs/bench-async-{stamp}")
    latency_ms = 100.0 if args.latency_ms is None else args.latency_ms
    sigma = 1.5 if args.latency_sigma is None else args.latency_sigma
    stop = process_flag()
    walls, busy, success, curves = {}, {}, {}, {}
    with cluster as kafka:
        for mode in MODES:
            cfg = RunConfig(
                steps=args.steps or 30,
                sync=mode == "sync",
                concurrency=args.concurrency,
                max_staleness=4 if args.max_staleness is None else args.max_staleness,
                latency_ms=latency_ms,
                latency_sigma=sigma,
                eval_episodes=args.eval_episodes,
            )
            print(
                f"== {mode}: {cfg.steps} steps, env latency median {latency_ms:.0f} ms "
                f"sigma {sigma}",
                flush=True,
            )
            result = Run(
                cfg, kafka, base / mode, f"bench-{stamp}-{mode}", stop.event, live=False
            ).execute()
            if result.status != "completed":
                raise RuntimeError(f"the {mode} run did not complete: {result.failure}")
            metrics = trainer_metrics(base / mode)
            walls[mode] = metrics[-1]["time"] - metrics[0]["time"]
            busy[mode] = busy_share(metrics)
            success[mode] = result.figures["success_final"]
            curves[mode] = metrics
    plot = base / "async_vs_sync.png"
    _plot(curves, plot)
    steps = len(curves["async"]) - 1
    figures: dict[str, Any] = {
        "steps_measured": steps,
        "latency_median_ms": latency_ms,
        "latency_sigma": sigma,
        "wall_async_s": round(walls["async"], 1),
        "wall_sync_s": round(walls["sync"], 1),
        "step_async_s": round(walls["async"] / steps, 3),
        "step_sync_s": round(walls["sync"] / steps, 3),
        "trainer_busy": round(busy["async"], 3),
        "trainer_busy_sync": round(busy["sync"], 3),
        "success_async": success["async"],
        "success_sync": success["sync"],
        "success_async_minus_sync_points": (
            round(100 * (success["async"] - success["sync"]), 1)
            if None not in (success["async"], success["sync"])
            else None
        ),
        "plot": str(plot),
        "run_dirs": str(base),
    }
    return {
        "bench": "async",
        "figures": figures,
        "ratios": {"async_vs_sync": walls["sync"] / walls["async"]},
        "goals": {
            "async_vs_sync": ">= 3",
            "trainer_busy": ">= 0.9",
            "success_async_minus_sync_points": ">= -5",
        },
    }


def _plot(curves: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode, metrics in curves.items():
        t0 = metrics[0]["time"]
        smooth = moving_mean([mean_over_envs(m["success"]) for m in metrics], 5)
        axes[0].plot([m["time"] - t0 for m in metrics], smooth, label=mode)
        axes[1].plot([m["step"] for m in metrics], smooth, label=mode)
    axes[0].set_xlabel("seconds since the first trainer step")
    axes[1].set_xlabel("trainer step (equal samples per step)")
    for ax in axes:
        ax.set_ylabel("success of training batches (5-step mean)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("asynchronous pipeline against the synchronous loop")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
