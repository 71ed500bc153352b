"""``rlstream bench producers``: the same run with 1, 2 and 4 producer processes, side
by side: what was produced, trained and dropped as stale, the trainer's busy share, and
the staleness of what was trained.

Every run is ``rlstream run`` at the default settings (but for the step count); admission
control across producers should keep the stale share near zero whatever the number of
producers, while the trainer stays busy as far as the machine's cores allow.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path
from typing import Any

from pipeline.launch.cluster import Cluster
from pipeline.launch.config import RunConfig
from pipeline.launch.run import Run
from pipeline.launch.stop import process_flag
from pipeline.observe.report import busy_share, trainer_metrics

COUNTS = (1, 2, 4)


def run(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(args.run_dir or f"runs/bench-producers-{stamp}")
    stop = process_flag()
    figures: dict[str, Any] = {}
    with cluster as kafka:
        for n in COUNTS:
            cfg = RunConfig(producers=n, steps=args.steps or 60, eval_episodes=0)
            print(f"== {n} producer(s): {cfg.steps} steps", flush=True)
            result = Run(
                cfg, kafka, base / f"p{n}", f"bench-{stamp}-p{n}", stop.event, live=False
            ).execute()
            if result.status != "completed":
                raise RuntimeError(f"the run of {n} producers failed: {result.failure}")
            f = result.figures
            metrics = trainer_metrics(base / f"p{n}")
            hist: Counter[int] = Counter()
            for m in metrics:
                hist.update({int(k): int(v) for k, v in m.get("staleness_hist", {}).items()})
            produced = f["trajectories_produced"]
            stale = f["trajectories_dropped_stale"]
            figures[f"p{n}_produced"] = produced
            figures[f"p{n}_trained"] = f["trajectories_trained"]
            figures[f"p{n}_dropped_stale"] = stale
            figures[f"p{n}_stale_share"] = round(stale / max(1, produced), 4)
            figures[f"p{n}_trainer_busy"] = round(busy_share(metrics, first=1), 3)
            figures[f"p{n}_step_s"] = round(
                (metrics[-1]["time"] - metrics[0]["time"]) / max(1, len(metrics) - 1), 3
            )
            figures[f"p{n}_staleness_hist"] = dict(sorted(hist.items()))
    figures["run_dirs"] = str(base)
    return {
        "bench": "producers",
        "figures": figures,
        "ratios": {
            f"step_time_p{n}_vs_p1": figures[f"p{n}_step_s"] / max(1e-9, figures["p1_step_s"])
            for n in COUNTS[1:]
        },
        "goals": {f"p{n}_stale_share": "<= 0.02" for n in COUNTS}
        | {"p4_trainer_busy": ">= 0.85 where the cores allow"},
    }
