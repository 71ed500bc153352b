"""A run's files, read back: trainer metrics, producer status, ledger; and its report.

A run directory holds ``config.json``, ``metrics.jsonl`` (one line per trainer step),
``producers/<name>.jsonl`` (one status line per producer per second), ``ledger.jsonl``,
``eval.json``, ``logs/`` and ``checkpoints/``. :func:`write_report` turns them into
``report.md`` and the PNG plots of ``plots/``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from pipeline.records.ledger import run_ledger

STALE_REASONS = ("stale", "stale_range")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Lines of a JSONL file that a running process may still be appending to (a torn
    last line is left for the next read)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def last_json(path: Path, window: int = 16384) -> dict[str, Any] | None:
    """The last complete JSON line of a growing file, reading only its end."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - window))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None


def trainer_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """One line per step (the last written, if a restarted trainer wrote a step again)."""
    by_step = {m["step"]: m for m in read_jsonl(run_dir / "metrics.jsonl")}
    return [by_step[s] for s in sorted(by_step)]


def producer_status(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    return {p.stem: read_jsonl(p) for p in sorted((run_dir / "producers").glob("*.jsonl"))}


def ledger_summary(run_dir: Path) -> dict[str, Any]:
    """What the durable ledger says: records trained, records dropped by reason."""
    entries = run_ledger(run_dir)
    dropped: Counter[str] = Counter()
    for e in entries:
        for d in e["dropped"]:
            where = d[3]
            dropped[d[4]] += where[1] - where[0] if isinstance(where, list) else 1
    steps = [e["step"] for e in entries if e["trained"]]
    return {
        "trained": sum(len(e["trained"]) for e in entries),
        "dropped": dict(dropped),
        "dropped_stale": sum(dropped[r] for r in STALE_REASONS),
        "steps": max(steps, default=0),
    }


def mean_over_envs(values: dict[str, float]) -> float:
    return sum(values.values()) / len(values) if values else math.nan


def moving_mean(values: list[float], window: int = 10) -> list[float]:
    """Mean of the last ``window`` values at each point (NaNs left out)."""
    out = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i - window + 1) : i + 1] if not math.isnan(v)]
        out.append(sum(part) / len(part) if part else math.nan)
    return out


def busy_series(metrics: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Trainer busy share between consecutive steps, against time (s since first step)."""
    xs, ys = [], []
    for a, b in itertools.pairwise(metrics):
        db = b.get("busy_s", 0.0) - a.get("busy_s", 0.0)
        di = b.get("idle_s", 0.0) - a.get("idle_s", 0.0)
        if db < 0 or di < 0 or db + di <= 0:  # a restart reset the timers
            continue
        xs.append(b["time"] - metrics[0]["time"])
        ys.append(db / (db + di))
    return xs, ys


def busy_share(metrics: list[dict[str, Any]], first: int = 0) -> float:
    """Busy share of the trainer from step line ``first`` to the last one."""
    if len(metrics) <= first + 1:
        return metrics[-1]["busy_share"] if metrics else math.nan
    a, b = metrics[first], metrics[-1]
    db = b.get("busy_s", 0.0) - a.get("busy_s", 0.0)
    di = b.get("idle_s", 0.0) - a.get("idle_s", 0.0)
    return db / (db + di) if db >= 0 and di >= 0 and db + di > 0 else b["busy_share"]


#: the report's figures, in order, with what each one means
FIGURES: dict[str, str] = {
    "status": "how the run ended",
    "success_initial": "held-out success of the initial policy",
    "success_final": "held-out success of the final policy",
    "success_gain_points": "gain in held-out success (percentage points)",
    "random_success": "success of random answers (the baseline)",
    "gain_over_random_points": "final success above random answers (percentage points)",
    "eval_episodes": "held-out episodes per evaluation",
    "tool_call_rate_initial": "held-out episodes of the initial policy that called a tool",
    "tool_call_rate_final": "held-out episodes of the final policy that called a tool",
    "tool_error_rate_initial": "tool calls of the initial policy that came back as errors",
    "tool_error_rate_final": "tool calls of the final policy that came back as errors",
    "success_with_tool_initial": "held-out success of the initial policy where it called a tool",
    "success_with_tool_final": "held-out success of the final policy where it called a tool",
    "success_without_tool_initial": (
        "held-out success of the initial policy where it answered without a tool (the "
        "no-tool baseline)"
    ),
    "success_without_tool_final": (
        "held-out success of the final policy where it answered without a tool"
    ),
    "warm_start": "the warm start: demonstrations, SFT steps and final loss, seconds",
    "steps": "trainer steps",
    "trajectories_produced": "trajectories produced",
    "trajectories_trained": "trajectories trained",
    "trajectories_dropped_stale": "trajectories dropped as too stale",
    "episodes_aborted_stale": (
        "episodes the producers ended early, certain to arrive too stale (abort_stale)"
    ),
    "dropped": "records dropped, by reason",
    "staleness_mean": "mean staleness of trained trajectories (versions)",
    "trainer_busy": "trainer busy share (defined below the table)",
    "final_batch_reward": "mean reward of the last training batch",
    "producer_versions": "policy version of each producer at the end",
    "restarts": "process restarts",
    "wall_s": "wall time, evaluations included (s)",
    "pipeline_wall_s": "time the producers and the trainer ran (s)",
}

BUSY_DEFINITION = (
    "**Busy share** is the share of the trainer's time, from the end of its first step "
    "(once compiled) to its last, spent training, checkpointing and announcing weights; "
    "the rest it waited for records. The headline, the table and the busy plot use this "
    "one figure."
)


def _fmt(v: Any, key: str = "") -> str:
    if v is None:
        return "not measured"
    if isinstance(v, float) and key.startswith(
        ("success_", "random_", "trainer_busy", "gain_", "tool_")
    ):
        return f"{v:.1%}" if not key.endswith("_points") else f"{v:+.1f}"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in sorted(v.items())) or "none"
    return str(v)


def model_text(model: Any) -> str:
    if not isinstance(model, dict):
        return f"`{model}`"
    if model.get("path"):
        return f"the checkpoint `{model['path']}`"
    return (
        f"a {model.get('num_layers')}-layer transformer (d_model {model.get('d_model')}, "
        f"{model.get('num_heads')} heads, vocabulary {model.get('vocab_size')})"
    )


def algorithm_text(grpo: Any, lora: Any = None) -> str:
    if not isinstance(grpo, dict):
        return "GRPO"
    name = {"gae": "PPO with a value head (GAE)", "rloo": "RLOO", "dr_grpo": "Dr. GRPO"}.get(
        grpo.get("advantage", ""), "GRPO"
    )
    correction = grpo.get("correction", "no")
    text = f"{name}, {correction} correction, learning rate {grpo.get('learning_rate')}"
    if isinstance(lora, dict) and lora.get("rank"):
        text += f", LoRA rank {lora['rank']}"
    return text


def headline(
    what: str,
    figures: dict[str, Any],
    producers_paused: float | None,
    causes: dict[str, float] | None = None,
) -> list[str]:
    """Three lines: what was trained, how far it got against random answers, where the
    time went."""
    f = figures
    init, final, rand = f.get("success_initial"), f.get("success_final"), f.get("random_success")
    if final is None:
        result = "**Result:** the policy was not evaluated on held-out episodes"
        result += "." if rand is None else f"; random answers succeed {rand:.1%}."
    else:
        # what was learned beyond the answer format comes first: the gain from a policy
        # that starts below the format counts learning the format too
        result = f"**Result:** held-out success {final:.1%} on {f.get('eval_episodes')} episodes"
        result += (
            "; no random baseline is known for this environment"
            if rand is None
            else f", {100 * (final - rand):+.1f} points over random answers ({rand:.1%})"
        )
        if init is not None:
            result += f"; it went from {init:.1%} ({100 * (final - init):+.1f} points)"
        result += "."
    busy = f.get("trainer_busy")
    time_line = f"**Time:** {f.get('wall_s')} s in all"
    if f.get("pipeline_wall_s") is not None:
        time_line += f", {f['pipeline_wall_s']} s of producers and trainer running"
    time_line += (
        f"; the trainer was busy {busy:.0%} of its time and waited for records the rest"
        if busy is not None
        else ""
    )
    if producers_paused is not None:
        time_line += (
            f"; producers were paused by admission control {producers_paused:.0%} of theirs"
        )
        held = [f"{CAUSE_WORDS[c]} {v:.0%}" for c, v in (causes or {}).items() if v >= 0.005]
        if held:
            time_line += f" ({', '.join(held)})"
    time_line += (
        f"; {f.get('trajectories_dropped_stale', 0)} trajectories were dropped as too stale."
    )
    return [f"**Trained:** {what}", "", result, "", time_line]


def environment_lines(env: dict[str, Any] | None) -> list[str]:
    if not env:
        return ["Not recorded (the trainer writes `environment.json` when it starts)."]
    jax_info = env.get("jax", {})
    versions = env.get("versions", {})
    return [
        f"- commit: `{env.get('commit', 'unknown')}`",
        f"- JAX backend: {jax_info.get('backend')} ({jax_info.get('devices')} device(s): "
        f"{', '.join(jax_info.get('device_kinds', []))}; {jax_info.get('processes')} process(es))",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
    ]


@dataclasses.dataclass
class Report:
    """What ``report.md`` says."""

    title: str
    what: str
    figures: dict[str, Any]
    config: dict[str, Any]
    plots: list[tuple[str, str]]
    environment: dict[str, Any] | None = None
    profile: str = ""
    episodes: list[str] = dataclasses.field(default_factory=list)


def write_report(run_dir: Path, report: Report) -> Path:
    """``report.md``: the headline, the figures in words, the plots, sample episodes,
    where the time went, the environment and the configuration."""
    producers = producer_status(run_dir)
    lines = [
        f"# rlstream run `{report.title}`",
        "",
        *headline(report.what, report.figures, paused_share(producers), paused_causes(producers)),
        "",
        "## Figures",
        "",
        "| figure | value |",
        "| --- | ---: |",
        *(
            f"| {FIGURES[k]} | {_fmt(report.figures[k], k)} |"
            for k in FIGURES
            if k in report.figures
        ),
        "",
        "Held-out success is measured on the same episodes for the initial and the final "
        "policy (tasks from a seed no producer uses, sampled as producers sample). Trained "
        "and dropped counts are read from the ledger. " + BUSY_DEFINITION,
        "",
        *producer_table(producers),
        "## Plots",
        "",
    ]
    for title, rel in report.plots:
        lines += [f"### {title}", "", f"![{title}]({rel})", ""]
    lines += ["## Sample episodes", ""]
    lines += report.episodes or ["None could be read (see the log of `rlstream report`)."]
    lines += [""]
    if report.profile:
        lines += [
            "## Where the time went",
            "",
            "From every process's spans (`rlstream profile`); the timeline is `trace.json` "
            "(open it in https://ui.perfetto.dev or chrome://tracing), the figures are in "
            "`profile.json`.",
            "",
            "```",
            report.profile,
            "```",
            "",
        ]
    lines += [
        "## Environment",
        "",
        *environment_lines(report.environment),
        "",
        "## Configuration",
        "",
        "```json",
        json.dumps(report.config, indent=2, sort_keys=True),
        "```",
        "",
        "Logs of every process are in `logs/`, trainer metrics in `metrics.jsonl`, "
        "producer status in `producers/`, the ledger in `ledger.jsonl`.",
        "",
    ]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def paused_share(producers: dict[str, list[dict[str, Any]]]) -> float | None:
    """The share of the producers' running time that admission control held new
    episodes back, from each producer's own clock (its last status line's ``paused_s``
    over its ``running_s``); for status files without them, the share of status lines
    (one per second) that say paused."""
    paused = running = 0.0
    for rows in producers.values():
        try:  # (a status line written by hand or torn says nothing: skipped)
            p, r = float(rows[-1]["paused_s"]), float(rows[-1]["running_s"])
        except (IndexError, KeyError, TypeError, ValueError):
            continue
        if 0 <= p <= r < float("inf"):
            paused, running = paused + p, running + r
    if running > 0:
        return paused / running
    rows = [r for lines in producers.values() for r in lines]
    return sum(1 for r in rows if r.get("paused")) / len(rows) if rows else None


#: what held producers back, in words (the causes of :mod:`pipeline.rollout.admission`)
CAUSE_WORDS = {
    "untrained": "by records the trainer had not read",
    "in_flight": "by episodes in flight",
    "weights_behind": "by weights behind the trainer's",
    "joining": "joining",
}


def paused_causes(producers: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """The share of the producers' running time paused by each cause, from each
    producer's last status line (``paused_by`` seconds over ``running_s``); lines without
    them, or with values that are not finite seconds within the running time, are
    skipped."""
    paused = dict.fromkeys(CAUSE_WORDS, 0.0)
    running = 0.0
    for rows in producers.values():
        try:
            r = float(rows[-1]["running_s"])
            by = {c: float(rows[-1]["paused_by"].get(c, 0.0)) for c in CAUSE_WORDS}
        except (IndexError, KeyError, TypeError, ValueError, AttributeError):
            continue
        if not (0 < r < float("inf")) or not all(0 <= v <= r for v in by.values()):
            continue
        running += r
        for c, v in by.items():
            paused[c] += v
    return {c: v / running for c, v in paused.items()} if running > 0 else {}


def producer_table(producers: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Report lines: each producer's episodes, its share of the staleness budget (the
    episodes in flight it allowed itself; the budget divided among live producers), the
    most it had in flight, and the time it spent paused by admission control."""
    if not producers:
        return []
    lines = [
        "## Producers",
        "",
        "| producer | episodes | budget share (last) | in flight (max) | peers seen | paused |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, rows in producers.items():
        if not rows:
            continue
        last = rows[-1]
        paused = paused_share({name: rows}) or 0.0
        lines.append(
            f"| {name} | {last.get('episodes', 0)} | {last.get('budget_share', 0)} | "
            f"{max(r.get('in_flight', 0) for r in rows)} | "
            f"{max(r.get('peers', 0) for r in rows)} | {paused:.0%} |"
        )
    return [*lines, ""]
