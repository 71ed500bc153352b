"""``rlstream bench learn``: does the default run learn every time, not on average?

The default ``rlstream run`` (the settings ``infra/dev.sh run`` uses) is run ``--seeds``
times, each with its own seed (the initial parameters, the producers' sampling and the
held-out tasks' draws differ), one after the other on the same broker. Each run evaluates
its initial and final policy on the same held-out episodes; the figures are the minimum,
median and maximum gain in points of held-out success, and the longest wall time of a
whole run (start-up, training, both evaluations).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from pipeline.launch.cluster import Cluster
from pipeline.launch.config import RunConfig
from pipeline.launch.run import Run
from pipeline.launch.stop import StopFlag


def run(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    seeds = args.seeds or 5
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(args.run_dir or f"runs/bench-learn-{stamp}")
    stop = StopFlag().install()
    gains: list[float] = []
    walls: list[float] = []
    with cluster as kafka:
        for seed in range(seeds):
            cfg = RunConfig(seed=seed, **({"steps": args.steps} if args.steps else {}))
            print(f"== seed {seed}: {cfg.steps} steps", flush=True)
            t0 = time.monotonic()
            result = Run(
                cfg,
                kafka,
                base / f"seed{seed}",
                f"bench-learn-{stamp}-{seed}",
                stop.event,
                live=False,
            ).execute()
            walls.append(time.monotonic() - t0)
            gain = result.figures.get("success_gain_points")
            if result.status != "completed" or gain is None:
                raise RuntimeError(f"the run of seed {seed} did not complete: {result.failure}")
            gains.append(float(gain))
            print(f"   gain {gain:+.1f} points in {walls[-1]:.0f} s", flush=True)
    return {
        "bench": "learn",
        "figures": {
            "seeds": seeds,
            "gain_points": gains,
            "gain_min_points": min(gains),
            "gain_median_points": statistics.median(gains),
            "gain_max_points": max(gains),
            "wall_s": [round(w, 1) for w in walls],
            "wall_max_s": round(max(walls), 1),
            "run_dirs": str(base),
        },
        "ratios": {},
        "goals": {"gain_min_points": ">= 30", "wall_max_s": "<= 600"},
    }
