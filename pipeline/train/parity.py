"""Logprob parity: does the trainer see the tokens as the sampler did?

A token the trainer's own version sampled has two log-probabilities: the sampler's
(written in the trajectory) and the trainer's (its forward pass at the start of the step).
They differ only by numerics (float32 against bfloat16, a KV cache against one full pass,
kernels): a gap beyond that is a defect (a wrong position, a template that re-tokenises
differently, weights that did not arrive whole) that biases every importance ratio. The
step returns the trainer-minus-sampler log-ratio of those tokens (``sampler_log_ratio``,
NaN elsewhere); :func:`summarize` makes its figures, and names the trajectories whose
tokens differ by more than a threshold.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def summarize(
    log_ratio: np.ndarray, members: Sequence[Any], first_row: int, threshold: float
) -> tuple[dict[str, float], list[str]]:
    """The step's parity figures from ``log_ratio [B, T]`` (trainer minus sampler, NaN on
    tokens not compared) and the ids of this member's trajectories (``members``, placed
    from global row ``first_row`` on) with a token whose gap exceeds ``threshold``.

    Figures: ``parity_tokens`` (tokens compared), and when there are any
    ``logprob_diff_mean``, ``logprob_diff_p99`` and ``logprob_diff_max`` of the absolute
    gap, and ``mismatch_kl``, the k3 estimate of KL(sampler || trainer) per token
    (``r - 1 - log r`` with ``r`` the trainer-over-sampler ratio: never negative, zero
    only where they agree)."""
    compared = log_ratio[~np.isnan(log_ratio)].astype(np.float64)
    figures: dict[str, float] = {"parity_tokens": float(compared.size)}
    if not compared.size:
        return figures, []
    gap = np.abs(compared)
    d = np.minimum(compared, 50.0)  # exp stays finite whatever the sampler wrote
    figures |= {
        "logprob_diff_mean": float(gap.mean()),
        "logprob_diff_p99": float(np.quantile(gap, 0.99)),
        "logprob_diff_max": float(gap.max()),
        "mismatch_kl": float(np.mean(np.exp(d) - 1.0 - d)),
    }
    flagged = []
    for m in members:
        n = m.trajectory.num_tokens
        own = log_ratio[first_row + m.row, m.start : m.start + n]
        own = own[~np.isnan(own)]
        if own.size and np.abs(own).max() > threshold:
            flagged.append(m.trajectory.trajectory_id)
    return figures, flagged


def check(
    log_ratio: Any, members: Sequence[Any], first_row: int, threshold: float, step: int
) -> dict[str, float]:
    """:func:`summarize` for training step ``step``, the trajectories beyond
    ``threshold`` logged by id (a warning); returns the figures."""
    figures, flagged = summarize(np.asarray(log_ratio), members, first_row, threshold)
    if flagged:
        log.warning(
            "logprob parity: step %d has %d trajectories whose sampler and trainer "
            "log-probabilities differ by more than %g (p99 %.3g, max %.3g): %s",
            step,
            len(flagged),
            threshold,
            figures["logprob_diff_p99"],
            figures["logprob_diff_max"],
            " ".join(flagged[:20]) + (" ..." if len(flagged) > 20 else ""),
        )
    return figures
