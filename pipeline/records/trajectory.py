"""The trajectory record in Python: numpy arrays, named tuples and one validation.

A :class:`Trajectory` is what a rollout producer builds and a trainer reads. Its arrays
are exactly the tokens the sampler saw and produced (token in, token out); the record
contract (lengths, spans, finite rewards) is checked by :func:`find_violation`, which
both the encoder (refusing to write) and the decoder (refusing to read) use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

ROLES = ("system", "user", "assistant", "tool", "environment")
STATUSES = ("ok", "truncated", "env_error", "timeout")

TOKEN_DTYPE = np.dtype("<i4")
MASK_DTYPE = np.dtype("u1")
LOGPROB_DTYPE = np.dtype("<f4")


#: the default bound of any reward's magnitude, for producers and trainer alike
MAX_ABS_REWARD = 1e6


class VersionSpan(NamedTuple):
    """Tokens ``[start, end)`` were sampled by policy version ``version``."""

    start: int
    end: int
    version: int


class Turn(NamedTuple):
    """One turn of the conversation: tokens ``[start, end)`` written by ``role``."""

    role: str
    start: int
    end: int
    tool_name: str = ""
    latency_s: float = 0.0


class Timings(NamedTuple):
    """Wall-clock timings of an episode (epoch milliseconds and seconds spent)."""

    started_at_ms: int
    finished_at_ms: int
    generation_s: float = 0.0
    env_s: float = 0.0


@dataclass(slots=True, eq=False)
class Trajectory:
    """One finished episode. Arrays are 1-D and of equal length ``T``:

    - ``tokens`` int32: prompt, policy tokens and observations, in order;
    - ``loss_mask`` uint8: 1 where the policy generated the token;
    - ``logprobs`` float32: behaviour log-probability of each policy token, 0 elsewhere.

    Fields are in the order of ``Trajectory.avsc`` (the decoder relies on it). Decoded
    trajectories hold read-only arrays.
    """

    trajectory_id: str
    group_id: str
    group_size: int
    group_index: int
    task_id: str
    producer_id: str
    env: str
    tokenizer_id: str
    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    version_spans: Sequence[VersionSpan]
    turns: Sequence[Turn]
    reward: float
    rewards: Mapping[str, float]
    status: str
    timings: Timings
    metadata: Mapping[str, str]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def min_version(self) -> int:
        """Oldest policy version among the policy tokens (-1 when there are none)."""
        return min((s.version for s in self.version_spans), default=-1)

    @property
    def max_version(self) -> int:
        """Newest policy version among the policy tokens (-1 when there are none)."""
        return max((s.version for s in self.version_spans), default=-1)


def find_violation(t: Trajectory) -> tuple[str, str] | None:
    """The first way ``t`` breaks the record contract, as ``(reason, message)``, or None.

    Reasons are those of :class:`pipeline.errors.RecordDecodeError`. Cost is a few
    vectorised passes over the arrays, no per-token Python work.
    """
    if t.group_size < 1 or not 0 <= t.group_index < t.group_size:
        return "invalid", f"group_index {t.group_index} outside group_size {t.group_size}"
    tokens, mask, logprobs = t.tokens, t.loss_mask, t.logprobs
    if tokens.ndim != 1 or mask.ndim != 1 or logprobs.ndim != 1:
        return "length_mismatch", "tokens, loss_mask and logprobs must be 1-D"
    n = tokens.shape[0]
    if mask.shape[0] != n or logprobs.shape[0] != n:
        return (
            "length_mismatch",
            f"tokens has {n} entries, loss_mask {mask.shape[0]}, logprobs {logprobs.shape[0]}",
        )
    if tokens.dtype != TOKEN_DTYPE or mask.dtype != MASK_DTYPE or logprobs.dtype != LOGPROB_DTYPE:
        return (
            "invalid",
            f"dtypes must be int32/uint8/float32, got {tokens.dtype}/{mask.dtype}/{logprobs.dtype}",
        )
    if n and mask.max() > 1:
        return "invalid", "loss_mask holds values other than 0 and 1"
    if not math.isfinite(t.reward) or not all(math.isfinite(v) for v in t.rewards.values()):
        return "non_finite", f"reward {t.reward!r} or a reward component is not finite"
    # A sum of finite float32 values is finite unless it overflows, which no real
    # log-probability does; one reduction instead of an isfinite pass and a mask.
    if n and not math.isfinite(logprobs.sum()):
        return "non_finite", "logprobs hold NaN or infinity"
    if t.status not in STATUSES:
        return "bad_enum", f"unknown status {t.status!r}"
    covered, prev_end = 0, 0
    for s in t.version_spans:
        if not prev_end <= s.start < s.end <= n or s.version < 0:
            return "bad_span", f"version span {tuple(s)} out of order or outside [0, {n})"
        covered += int(np.count_nonzero(mask[s.start : s.end]))
        prev_end = s.end
    if covered != np.count_nonzero(mask):
        return "bad_span", "version spans do not cover every policy token"
    prev_end = 0
    for turn in t.turns:
        if turn.role not in ROLES:
            return "bad_enum", f"unknown role {turn.role!r}"
        if not prev_end <= turn.start <= turn.end <= n:
            return "bad_span", f"turn {turn.role}[{turn.start}:{turn.end}] out of order or range"
        prev_end = turn.end
    return None
