"""``rlstream bench learn``: does the default run learn every time, not on average? And
an ablation of any of its settings, the same way.

The default ``rlstream run`` (the settings ``infra/dev.sh run`` uses) is run ``--seeds``
times, each with its own seed (the initial parameters, the producers' sampling and the
held-out tasks' draws differ), one after the other on the same broker. Each run evaluates
its initial and final policy on the same held-out episodes; the figures are the minimum,
median and maximum gain in points of held-out success, the same of the final success above
what random answers reach (``gain_over_random_*``: what was learned beyond the answer
format; the gate, where the environment knows its random baseline), and the longest wall
time of a whole run (start-up, training, both evaluations).

``--config FILE`` runs the experiment of an ``rlstream run`` configuration instead of the
default (``--config recipes/tool-arithmetic.yaml``: each seed makes its own demonstrations,
checkpoint and SFT warm start, then RL; its wall time counts them all). Where the runs
warm-start, the gate is the gain over that start (``gain_over_start_min_points``) and the
tool-call rate of the final policy against the start's.

``--env`` and ``--env-option`` set the environment of every run (any adapter:
``--env reasoning-gym:letter_counting --env-option min_words=3``).

``--grid KEY=V1,V2,...`` (repeatable; any setting of ``rlstream run`` by its dotted name)
runs every combination of the values, each over the same seeds (``--first-seed`` on),
and reports the figures per combination: the staleness ablation is
``--grid max_staleness=8 --grid grpo.correction=none,tis,decoupled --seeds 2``.
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

from connectors.base import parse_options
from pipeline.errors import InvalidConfigError
from pipeline.launch.cluster import Cluster
from pipeline.launch.config import RunConfig
from pipeline.launch.run import Run
from pipeline.launch.stop import process_flag
from pipeline.settings import leaf_paths, resolve


def grid(items: list[str]) -> list[dict[str, Any]]:
    """Every combination of ``KEY=V1,V2,...`` items, as settings of ``rlstream run`` by
    dotted name (values read as JSON where they parse, else as text); one empty
    combination without items. An unknown key is refused with the nearest known one."""
    known = leaf_paths(RunConfig)
    axes: list[list[tuple[str, Any]]] = []
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise InvalidConfigError(f"--grid {item!r} is not KEY=V1,V2,...")
        if key not in known:
            near = difflib.get_close_matches(key, list(known), 1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise InvalidConfigError(f"--grid: {key!r} is not a setting of rlstream run{hint}")
        axes.append([(key, _value(v)) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)]


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _label(settings: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in settings.items()) or "default"


def run(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    seeds = args.seeds or 5
    first = getattr(args, "first_seed", 0) or 0
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(args.run_dir or f"runs/bench-learn-{stamp}")
    combos = grid(list(getattr(args, "grid", None) or []))
    fixed: dict[str, Any] = {"steps": args.steps} if args.steps else {}
    if getattr(args, "env", None):
        fixed["env"] = args.env
    if getattr(args, "env_option", None):
        fixed["env_options"] = parse_options(args.env_option)
    file = getattr(args, "config", None)
    configs = [resolve(RunConfig, {**fixed, **c}, file=file) for c in combos]  # refused now
    stop = process_flag()
    results: list[dict[str, Any]] = []
    with cluster as kafka:
        for n, (settings, cfg) in enumerate(zip(combos, configs, strict=True)):
            gains: list[float] = []
            over: list[float] = []
            walls: list[float] = []
            finals: list[float] = []
            stale: list[float] = []
            calls: list[tuple[float | None, float | None]] = []
            with_tool: list[tuple[float | None, float | None]] = []
            starts: list[float | None] = []
            sft_loss: list[float | None] = []
            for seed in range(first, first + seeds):
                seeded = resolve(RunConfig, {**fixed, **settings, "seed": seed}, file=file)
                print(f"== {_label(settings)} seed {seed}: {cfg.steps} steps", flush=True)
                t0 = time.monotonic()
                result = Run(
                    seeded,
                    kafka,
                    base / (f"{n}-seed{seed}" if len(combos) > 1 else f"seed{seed}"),
                    f"bench-learn-{stamp}-{n}-{seed}",
                    stop.event,
                    live=False,
                ).execute()
                walls.append(time.monotonic() - t0)
                gain = result.figures.get("success_gain_points")
                if result.status != "completed" or gain is None:
                    raise RuntimeError(
                        f"the run of {_label(settings)} seed {seed} did not complete: "
                        f"{result.failure}"
                    )
                gains.append(float(gain))
                beyond = result.figures.get("gain_over_random_points")
                if beyond is not None:  # None: the environment knows no random baseline
                    over.append(float(beyond))
                finals.append(float(result.figures["success_final"]))
                starts.append(result.figures.get("success_initial"))
                warm = result.figures.get("warm_start") or {}
                sft_loss.append(warm.get("sft_loss_final"))
                stale.append(float(result.figures.get("staleness_mean") or 0.0))
                calls.append(_start_and_final(result.figures, "tool_call_rate"))
                with_tool.append(_start_and_final(result.figures, "success_with_tool"))
                beyond_text = "" if beyond is None else f", {beyond:+.1f} over random answers"
                print(f"   gain {gain:+.1f} points{beyond_text}, in {walls[-1]:.0f} s", flush=True)
            results.append(
                {
                    "settings": settings,
                    "gain_points": gains,
                    "gain_min_points": min(gains),
                    "gain_median_points": statistics.median(gains),
                    "gain_max_points": max(gains),
                    # the same: the gain over the policy each run started from
                    "gain_over_start_min_points": min(gains),
                    "tool_call_rate_start": [c[0] for c in calls],
                    "tool_call_rate_final": [c[1] for c in calls],
                    # in how many seeds the final policy calls tools more often than its start
                    "tool_call_rate_up_seeds": sum(
                        1 for a, b in calls if a is not None and b is not None and b > a
                    ),
                    # success where the policy called the tool: what the calls are worth
                    "success_with_tool_start": [c[0] for c in with_tool],
                    "success_with_tool_final": [c[1] for c in with_tool],
                    "gain_over_random_points": over,
                    "gain_over_random_min_points": min(over) if over else None,
                    "gain_over_random_median_points": statistics.median(over) if over else None,
                    "success_start": starts,
                    "success_final": finals,
                    # each seed's warm start: its SFT's last loss (None: no warm start)
                    "sft_loss_final": sft_loss,
                    "staleness_mean": [round(s, 2) for s in stale],
                    "wall_s": [round(w, 1) for w in walls],
                    "wall_max_s": round(max(walls), 1),
                }
            )
    figures: dict[str, Any] = {"seeds": seeds, "first_seed": first, "run_dirs": str(base)}
    if len(results) == 1:
        figures |= {k: v for k, v in results[0].items() if k != "settings"}
    else:
        figures["variants"] = {_label(r["settings"]): r for r in results}
        figures["gain_min_points"] = min(r["gain_min_points"] for r in results)
        figures["gain_over_start_min_points"] = figures["gain_min_points"]
        known = [r["gain_over_random_min_points"] for r in results]
        figures["gain_over_random_min_points"] = None if None in known else min(known)
        figures["wall_max_s"] = max(r["wall_max_s"] for r in results)
    goals = (
        # a warm start: 20 points over the SFT start in every seed, SFT and RL in 20 minutes
        {"gain_over_start_min_points": ">= 20", "wall_max_s": "<= 1200"}
        if any(c.warm_start.enabled for c in configs)
        # else what is learned beyond the answer format, in every seed
        else {"gain_over_random_min_points": ">= 15", "wall_max_s": "<= 600"}
    )
    return {"bench": "learn", "figures": figures, "ratios": {}, "goals": goals}


def _start_and_final(figures: dict[str, Any], name: str) -> tuple[float | None, float | None]:
    """A run's figure ``name`` of its start and of its final policy."""
    return figures.get(f"{name}_initial"), figures.get(f"{name}_final")
