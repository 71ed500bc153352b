"""``rlstream bench async``: wall-clock time to the same number of trainer steps, the
asynchronous pipeline against two synchronous loops, in one run: rlstream's own
(``rlstream run --sync``: a checkpoint, an announcement and a producer's restore every
step) and the loop a user would write without rlstream (:mod:`pipeline.bench.sync_loop`:
one process, no Kafka, the parameters copied in memory, a checkpoint every 10 steps).
``--rounds`` rounds of the three, interleaved; the figures are the medians.

The modes run the same components, model, batch and environment,
whose latency is heavy-tailed (log-normal; a batch of the synchronous loop waits for its
slowest episode). Time is measured between the trainer's first and last step (so process
start-up and compilation, equal in both, do not count); the trainer's busy share over the
same span. Both final policies are evaluated on the same held-out episodes: they were
trained on the same number of samples.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from pipeline.bench import sync_loop
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
    rounds = max(1, args.rounds)
    stop = process_flag()
    walls: dict[str, list[float]] = {m: [] for m in (*MODES, "in_process")}
    busy: dict[str, list[float]] = {m: [] for m in walls}
    success: dict[str, list[float]] = {m: [] for m in MODES}
    curves: dict[str, list[dict[str, Any]]] = {}
    parts: list[dict[str, Any]] = []
    with cluster as kafka:
        for r in range(rounds):  # interleaved: a drift of the machine hits every mode alike
            for mode in MODES:
                cfg = _config(args, mode == "sync", latency_ms, sigma)
                print(
                    f"== round {r + 1}/{rounds} {mode}: {cfg.steps} steps, env latency median "
                    f"{latency_ms:.0f} ms sigma {sigma}",
                    flush=True,
                )
                where = base / f"{mode}-{r}"
                result = Run(
                    cfg, kafka, where, f"bench-{stamp}-{mode}-{r}", stop.event, live=False
                ).execute()
                if result.status != "completed":
                    raise RuntimeError(f"the {mode} run did not complete: {result.failure}")
                metrics = trainer_metrics(where)
                walls[mode].append(metrics[-1]["time"] - metrics[0]["time"])
                busy[mode].append(busy_share(metrics))
                success[mode].append(result.figures["success_final"])
                curves[mode] = metrics
            cfg = _config(args, True, latency_ms, sigma)
            print(f"== round {r + 1}/{rounds} in-process synchronous loop (no Kafka)", flush=True)
            loop = sync_loop.run(cfg, base / f"in-process-{r}")
            walls["in_process"].append(loop["wall_s"])
            busy["in_process"].append(loop["trainer_busy"])
            parts.append({k: loop[k] for k in ("generate_s", "train_s", "swap_s", "checkpoint_s")})
    plot = base / "async_vs_sync.png"
    _plot(curves, plot)
    steps = len(curves["async"]) - 1
    wall = {m: statistics.median(v) for m, v in walls.items()}
    success_m = {m: statistics.median(v) if None not in v else None for m, v in success.items()}
    figures: dict[str, Any] = {
        "steps_measured": steps,
        "rounds": rounds,
        "latency_median_ms": latency_ms,
        "latency_sigma": sigma,
        "wall_async_s": round(wall["async"], 1),
        "wall_sync_s": round(wall["sync"], 1),
        "wall_sync_in_process_s": round(wall["in_process"], 1),
        "walls_s": {m: [round(w, 1) for w in v] for m, v in walls.items()},
        "step_async_s": round(wall["async"] / steps, 3),
        "step_sync_s": round(wall["sync"] / steps, 3),
        "step_sync_in_process_s": round(wall["in_process"] / steps, 3),
        # busy: training steps (with the pipeline's trainer also its checkpoints and
        # announcements, which the in-process loop reports apart, below)
        "trainer_busy": round(statistics.median(busy["async"]), 3),
        "trainer_busy_sync": round(statistics.median(busy["sync"]), 3),
        "trainer_busy_sync_in_process": round(statistics.median(busy["in_process"]), 3),
        "in_process_seconds": {
            k: round(statistics.median(p[k] for p in parts), 2) for k in parts[0]
        },
        "success_async": success_m["async"],
        "success_sync": success_m["sync"],
        "success_async_minus_sync_points": _points(success_m["async"], success_m["sync"]),
        "plot": str(plot),
        "run_dirs": str(base),
    }
    return {
        "bench": "async",
        "figures": figures,
        "ratios": {
            "async_vs_sync": wall["sync"] / wall["async"],
            # against the loop a user would write: one process, no Kafka, parameters
            # copied in memory, a checkpoint every 10 steps
            "async_vs_sync_in_process": wall["in_process"] / wall["async"],
        },
        "goals": {
            "async_vs_sync": ">= 3",
            "async_vs_sync_in_process": ">= 2.5",
            "trainer_busy": ">= 0.9",
            "success_async_minus_sync_points": ">= -5",
        },
    }


def _points(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(100 * (a - b), 1)


def _config(args: argparse.Namespace, sync: bool, latency_ms: float, sigma: float) -> RunConfig:
    return RunConfig(
        steps=args.steps or 30,
        sync=sync,
        concurrency=args.concurrency or 256,
        max_staleness=4 if args.max_staleness is None else args.max_staleness,
        latency_ms=latency_ms,
        latency_sigma=sigma,
        eval_episodes=args.eval_episodes,
    )


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
