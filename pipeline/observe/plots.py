"""The plots of a run's report (``plots/*.png``), from the files the run left.

Each plot has a title, labelled axes with units and the limits that bound what it shows
(the staleness bound, the admission budget, the random baseline).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections import Counter
from pathlib import Path
from typing import Any

from pipeline.observe.report import (
    busy_series,
    moving_mean,
    producer_status,
    trainer_metrics,
)
from pipeline.records.ledger import run_ledger


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the plots draw besides the data."""

    #: the run's start (epoch seconds): time axes count minutes from it
    start_time: float
    #: the staleness bound (versions); None: not known
    max_staleness: int | None = None
    #: the admission budget: trajectories not yet trained plus episodes in flight
    admission_budget: int | None = None
    #: held-out evaluations: (policy version, success rate)
    evals: tuple[tuple[int, float], ...] = ()
    #: success of random answers (None: not known)
    random_success: float | None = None


def render(run_dir: Path, limits: Limits) -> list[tuple[str, str]]:
    """Write every plot; (title, path relative to ``run_dir``) of each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    metrics = trainer_metrics(run_dir)
    producers = producer_status(run_dir)
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    made: list[tuple[str, str]] = []

    def save(fig: Any, name: str, title: str) -> None:
        fig.suptitle(title, fontsize=11)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        made.append((title, f"plots/{name}"))

    def minutes(t: float) -> float:
        return (t - limits.start_time) / 60

    steps = [m["step"] for m in metrics]
    envs = sorted({e for m in metrics for e in m.get("reward", {})})

    # learning: reward and success of the training batches, held-out success; and where
    # the policy calls tools, how often it does and how often a call comes back an error
    tooled = any(v for m in metrics for v in m.get("tool_call_rate", {}).values())
    fig, axes = plt.subplots(1, 3 if tooled else 2, figsize=(16 if tooled else 11, 4))
    ax_r, ax_s = axes[0], axes[1]
    if tooled:
        ax_t = axes[2]
        for i, env in enumerate(envs):
            for key, ls, what in (
                ("tool_call_rate", "-", "calls"),
                ("tool_error_rate", ":", "errors"),
            ):
                rate = [m.get(key, {}).get(env, math.nan) for m in metrics]
                ax_t.plot(
                    steps, moving_mean(rate), color=f"C{i}", ls=ls, lw=2, label=f"{env} {what}"
                )
        ax_t.set(
            title="tools: episodes calling one, calls that erred (10-step means)",
            xlabel="trainer step",
            ylabel="share",
            ylim=(-0.02, 1.02),
        )
        ax_t.grid(alpha=0.3)
        _legend(ax_t, loc="upper left", fontsize=8)
    for i, env in enumerate(envs):
        color = f"C{i}"
        reward = [m["reward"].get(env, math.nan) for m in metrics]
        success = [m["success"].get(env, math.nan) for m in metrics]
        ax_r.plot(steps, reward, color=color, alpha=0.25, lw=0.8, label=f"{env}, each step")
        ax_r.plot(steps, moving_mean(reward), color=color, lw=2, label=f"{env}, 10-step mean")
        ax_s.plot(
            steps, moving_mean(success), color=color, lw=2, label=f"{env} batches, 10-step mean"
        )
    if limits.evals:
        ax_s.plot(
            [v for v, _ in limits.evals],
            [s for _, s in limits.evals],
            "o--",
            color="black",
            ms=7,
            label="held-out episodes",
        )
    if limits.random_success is not None:
        ax_s.axhline(limits.random_success, color="grey", ls=":", label="random answers")
    ax_r.set(title="reward of training batches", xlabel="trainer step", ylabel="mean reward")
    ax_s.set(title="success", xlabel="trainer step (policy version)", ylabel="success rate")
    ax_s.set_ylim(-0.02, 1.02)
    for ax in (ax_r, ax_s):
        ax.grid(alpha=0.3)
        _legend(ax, loc="upper left", fontsize=8)
    save(fig, "learning.png", "Learning: reward and success against trainer steps")

    # the optimisation: loss, KL, entropy, gradient norm, clip fraction, logprob parity,
    # throughput
    fig, axes = plt.subplots(2, 4, figsize=(17, 6.5))
    panels = [
        ("loss", ["loss"], "policy loss"),
        ("KL divergence", ["kl_behaviour", "kl"], "nats per token"),
        ("entropy", ["entropy"], "nats per token"),
        ("gradient norm", ["grad_norm"], "global L2 norm"),
        ("clip fraction", ["clip_fraction"], "share of policy tokens"),
        (
            "logprob parity (trainer's own version)",
            ["logprob_diff_mean", "logprob_diff_p99", "mismatch_kl"],
            "|sampler - trainer| (nats), KL",
        ),
    ]
    labels = {
        "kl_behaviour": "to the behaviour policy",
        "kl": "to the reference policy",
        "logprob_diff_mean": "mean gap",
        "logprob_diff_p99": "p99 gap",
        "mismatch_kl": "KL(sampler || trainer)",
    }
    for ax, (title, keys, ylabel) in zip(axes.flat, panels, strict=False):
        for key in keys:
            ys = [float(m.get(key, math.nan)) for m in metrics]
            if any(not math.isnan(y) for y in ys):
                ax.plot(
                    steps, ys, ".-" if key in labels else "-", lw=1.2, label=labels.get(key, key)
                )
        if len(keys) > 2:  # gaps from 1e-12 (float32) to whole nats (a defect)
            ax.set_yscale("symlog", linthresh=1e-8)
        if len(keys) > 1:
            _legend(ax, fontsize=8)
        ax.set(title=title, xlabel="trainer step", ylabel=ylabel)
        ax.grid(alpha=0.3)
    axes.flat[7].axis("off")
    ax = axes.flat[6]
    tx, ty = trained_rate(run_dir, metrics)
    ax.plot([minutes(t) for t in tx], ty, lw=1.5, label="trained")
    for name, rows in producers.items():
        px, py = produced_rate(rows)
        ax.plot([minutes(t) for t in px], py, ":", lw=1.2, label=f"produced by {name}")
    ax.set(title="throughput", xlabel="minutes since start", ylabel="trajectories per second")
    ax.grid(alpha=0.3)
    _legend(ax, fontsize=8)
    save(fig, "training.png", "Optimisation: loss, KL, entropy, gradient, clipping, throughput")

    # staleness of what was trained, with the bound
    hist: Counter[int] = Counter()
    for m in metrics:
        for k, v in m.get("staleness_hist", {}).items():
            hist[int(k)] += int(v)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ks = sorted(hist)
    ax.bar(ks, [hist[k] for k in ks], color="C0")
    if limits.max_staleness is not None:
        ax.axvline(
            limits.max_staleness + 0.5,
            color="C3",
            ls="--",
            label=f"bound: max_staleness {limits.max_staleness} (older ones are dropped)",
        )
        _legend(ax, fontsize=8)
    ax.set(
        xlabel="staleness (trainer version minus the oldest version of its tokens)",
        ylabel="trained trajectories",
    )
    ax.set_xticks(sorted({*ks, *([limits.max_staleness] if limits.max_staleness else [])}))
    save(fig, "staleness.png", "Staleness of the trained trajectories")

    # the trainer's busy share, rolling, with its mean
    bx, by = busy_series(metrics)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    if by:
        ax.plot([x / 60 for x in bx], moving_mean(by), lw=1.8, label="10-step rolling share")
        mean = sum(by) / len(by)
        ax.axhline(mean, color="C3", ls="--", label=f"mean {mean:.0%}")
        _legend(ax, fontsize=8, loc="lower right")
    ax.set_ylim(0, 1.05)
    ax.set(
        xlabel="minutes since the first step",
        ylabel="busy share (training, checkpointing)",
    )
    ax.grid(alpha=0.3)
    save(fig, "trainer_busy.png", "Trainer busy share (the rest is waiting for records)")

    # the backlog against the admission budget
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.plot(
        [minutes(m["time"]) for m in metrics],
        [m.get("lag", 0) for m in metrics],
        lw=1.8,
        label="trainer group's lag (records not trained yet)",
    )
    for i, (name, rows) in enumerate(producers.items()):
        ts = [r["time"] for r in rows]
        width = window_s(ts)
        wx, avg, peak = windows(ts, [r.get("lag", 0) + r.get("in_flight", 0) for r in rows], width)
        wm = [minutes(t) for t in wx]
        ax.fill_between(wm, avg, peak, color=f"C{i + 1}", alpha=0.2, lw=0)
        ax.plot(
            wm,
            avg,
            color=f"C{i + 1}",
            lw=1.2,
            label=f"{name}: lag plus its episodes in flight (mean, max per {width:.0f} s)",
        )
    if limits.admission_budget is not None:
        ax.axhline(limits.admission_budget, color="C3", ls="--", label="admission budget")
    ax.set(xlabel="minutes since start", ylabel="trajectories")
    ax.grid(alpha=0.3)
    _legend(ax, fontsize=8)
    save(fig, "lag.png", "Backlog of the trainer group against the admission budget")

    # how far behind the trainer each producer's weights are
    fig, ax = plt.subplots(figsize=(8, 3.8))
    times = [m["time"] for m in metrics]
    for i, (name, rows) in enumerate(producers.items()):
        gap = [trainer_version(times, metrics, r["time"]) - r.get("version", 0) for r in rows]
        ts = [r["time"] for r in rows]
        width = window_s(ts)
        wx, avg, peak = windows(ts, gap, width)
        wm = [minutes(t) for t in wx]
        ax.fill_between(wm, avg, peak, color=f"C{i}", alpha=0.2, lw=0)
        ax.plot(wm, avg, color=f"C{i}", lw=1.5, label=f"{name} (mean, max per {width:.0f} s)")
    if limits.max_staleness is not None:
        ax.axhline(limits.max_staleness, color="C3", ls="--", label="staleness bound")
    ax.set(xlabel="minutes since start", ylabel="versions behind the trainer")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    _legend(ax, fontsize=8)
    save(fig, "versions.png", "Version gap: trainer's policy version minus each producer's")
    return made


def window_s(times: list[float]) -> float:
    """The window that summarises a per-second line into about 60 points (at least 1 s)."""
    return max(1.0, round((times[-1] - times[0]) / 60)) if times else 1.0


def windows(
    times: list[float], values: list[float], width_s: float
) -> tuple[list[float], list[float], list[float]]:
    """Mean and maximum of ``values`` over consecutive windows of ``width_s`` seconds
    (at each window's middle): a line that reads at a glance instead of a band."""
    xs: list[float] = []
    means: list[float] = []
    tops: list[float] = []
    chunk: list[float] = []
    start = times[0] if times else 0.0
    for t, v in zip([*times, math.inf], [*values, math.nan], strict=True):
        if t - start >= width_s and chunk:
            xs.append(start + width_s / 2)
            means.append(sum(chunk) / len(chunk))
            tops.append(max(chunk))
            chunk, start = [], t
        if not math.isnan(v):
            chunk.append(v)
    return xs, means, tops


def _legend(ax: Any, **kw: Any) -> None:
    """A legend when something labelled was drawn."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


def trainer_version(times: list[float], metrics: list[dict[str, Any]], t: float) -> int:
    """The trainer's version at time ``t`` (the last step at or before it)."""
    i = bisect.bisect_right(times, t)
    return int(metrics[i - 1]["version"]) if i else 0


def trained_rate(run_dir: Path, metrics: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Trajectories trained per second between consecutive steps (from the ledger)."""
    per_step: Counter[int] = Counter()
    for e in run_ledger(run_dir):
        per_step[e["step"]] += len(e["trained"])
    xs, ys = [], []
    for a, b in itertools.pairwise(metrics):
        dt = b["time"] - a["time"]
        if dt > 0:
            xs.append(b["time"])
            ys.append(per_step[b["step"]] / dt)
    return xs, moving_mean(ys)


def produced_rate(rows: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """A producer's episodes per second, over 10-second windows of its status lines."""
    xs, ys = [], []
    last = None
    for r in rows:
        if last is None:
            last = r
            continue
        dt = r["time"] - last["time"]
        if dt >= 10 or r is rows[-1]:
            if dt > 0 and r.get("episodes", 0) >= last.get("episodes", 0):
                xs.append(r["time"])
                ys.append((r.get("episodes", 0) - last.get("episodes", 0)) / dt)
            last = r
    return xs, ys
