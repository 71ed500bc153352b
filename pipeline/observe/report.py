"""A run's files, read back: trainer metrics, producer status, ledger; and its report.

A run directory holds ``config.json``, ``metrics.jsonl`` (one line per trainer step),
``producers/<name>.jsonl`` (one status line per producer per second), ``ledger.jsonl``,
``eval.json``, ``logs/`` and ``checkpoints/``. :func:`write_report` turns them into
``report.md`` and the PNG plots of ``plots/``.
"""

from __future__ import annotations

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


def plots(run_dir: Path, start_time: float) -> list[tuple[str, str]]:
    """Write the PNG plots; returns (title, relative path) pairs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = trainer_metrics(run_dir)
    producers = producer_status(run_dir)
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    made: list[tuple[str, str]] = []

    def save(fig: Any, name: str, title: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        made.append((title, f"plots/{name}"))

    steps = [m["step"] for m in metrics]
    minutes = [(m["time"] - start_time) / 60 for m in metrics]
    envs = sorted({e for m in metrics for e in m.get("reward", {})})

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, xs, xlabel in ((axes[0], steps, "trainer step"), (axes[1], minutes, "minutes")):
        for env in envs:
            reward = [m["reward"].get(env, math.nan) for m in metrics]
            success = [m["success"].get(env, math.nan) for m in metrics]
            ax.plot(xs, reward, alpha=0.3, lw=0.8, label=f"reward {env}")
            ax.plot(xs, moving_mean(reward), lw=1.5, label=f"reward {env}, 10-step mean")
            ax.plot(xs, moving_mean(success), "--", lw=1.5, label=f"success {env}, 10-step mean")
        ax.set_xlabel(xlabel)
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    axes[0].set_title("training batches against step")
    axes[1].set_title("training batches against wall-clock time")
    save(fig, "learning.png", "Reward and success of training batches")

    hist: Counter[int] = Counter()
    for m in metrics:
        for k, v in m.get("staleness_hist", {}).items():
            hist[int(k)] += int(v)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ks = sorted(hist)
    ax.bar(ks, [hist[k] for k in ks])
    ax.set_xlabel("staleness (trainer version - oldest token version)")
    ax.set_ylabel("trained trajectories")
    ax.set_xticks(ks)
    save(fig, "staleness.png", "Staleness of trained trajectories")

    bx, by = busy_series(metrics)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.fill_between([x / 60 for x in bx], by, step="pre", alpha=0.6, label="busy")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("minutes since the first step")
    ax.set_ylabel("busy share between steps")
    save(fig, "trainer_busy.png", "Trainer busy (training, checkpointing) against idle time")

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(minutes, [m.get("lag", 0) for m in metrics], label="trainer's view")
    for name, rows in producers.items():
        ax.plot(
            [(r["time"] - start_time) / 60 for r in rows],
            [r.get("lag", 0) for r in rows],
            ":",
            label=f"{name}'s view",
        )
    ax.set_xlabel("minutes")
    ax.set_ylabel("records not yet trained or dropped")
    ax.legend(fontsize=8)
    save(fig, "lag.png", "Consumer lag of the trainer group")

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.step(minutes, [m["version"] for m in metrics], where="post", label="trainer", lw=2)
    for name, rows in producers.items():
        ax.step(
            [(r["time"] - start_time) / 60 for r in rows],
            [r.get("version", 0) for r in rows],
            where="post",
            label=name,
        )
    ax.set_xlabel("minutes")
    ax.set_ylabel("policy version")
    ax.legend(fontsize=8)
    save(fig, "versions.png", "Policy version per producer")
    return made


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in sorted(v.items())) or "none"
    return str(v)


def write_report(
    run_dir: Path,
    figures: dict[str, Any],
    config: dict[str, Any],
    start_time: float,
    profile: str = "",
) -> Path:
    """``report.md`` with the figures, the resolved configuration and the plots."""
    made = plots(run_dir, start_time)
    lines = [
        f"# rlstream run `{run_dir.name}`",
        "",
        f"Mode: **{'synchronous' if config.get('sync') else 'asynchronous'}**, "
        f"environment `{config.get('env')}`, {config.get('producers')} producer(s) of "
        f"{config.get('concurrency')} episodes, model {_model_text(config.get('model'))}.",
        "",
        "## Result",
        "",
        "| figure | value |",
        "| --- | ---: |",
        *(f"| `{k}` | {_fmt(v)} |" for k, v in figures.items()),
        "",
        "`success_initial` and `success_final` are the success rates of the initial and "
        "the final policy on the same held-out episodes (tasks from a seed no producer "
        "uses, played locally with the producers' sampling). Trained and dropped counts "
        "are read from the ledger.",
        "",
        *producer_table(producer_status(run_dir)),
        "## Plots",
        "",
    ]
    for title, rel in made:
        lines += [f"### {title}", "", f"![{title}]({rel})", ""]
    if profile:
        lines += [
            "## Where the time went",
            "",
            "From every process's spans (`rlstream profile`); the timeline is `trace.json` "
            "(open it in https://ui.perfetto.dev or chrome://tracing), the figures are in "
            "`profile.json`.",
            "",
            "```",
            profile,
            "```",
            "",
        ]
    lines += [
        "## Configuration",
        "",
        "```json",
        json.dumps(config, indent=2, sort_keys=True),
        "```",
        "",
        "Logs of every process are in `logs/`, trainer metrics in `metrics.jsonl`, "
        "producer status in `producers/`, the ledger in `ledger.jsonl`.",
        "",
    ]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def _model_text(model: Any) -> str:
    if not isinstance(model, dict):
        return f"`{model}`"
    return (
        f"`d_model={model.get('d_model')} layers={model.get('num_layers')} "
        f"heads={model.get('num_heads')} vocab={model.get('vocab_size')}`"
    )


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
        paused = sum(1 for r in rows if r.get("paused")) / len(rows)
        lines.append(
            f"| {name} | {last.get('episodes', 0)} | {last.get('budget_share', 0)} | "
            f"{max(r.get('in_flight', 0) for r in rows)} | "
            f"{max(r.get('peers', 0) for r in rows)} | {paused:.0%} |"
        )
    return [*lines, ""]
