"""Rewards into advantages, on the host, per GRPO group (float64: rewards are bounded by
the training contract, so no statistic overflows).

- ``grpo``: ``(r - mean) / (std + eps)`` (the group's population std);
- ``drgrpo``: ``r - mean`` (Dr. GRPO: no division by the std, which favours groups
  that are nearly solved or nearly hopeless);
- ``rloo``: ``r_i - mean_{j != i} r_j`` (REINFORCE leave-one-out);

and DAPO's two reward-side tools: overlong shaping (a penalty that grows linearly over
the last ``buffer`` tokens before ``max_tokens`` and is complete past it) and dynamic
sampling (a group whose rewards are all equal carries no signal and is dropped).
"""

from __future__ import annotations

import numpy as np


def advantages(rewards: np.ndarray, how: str, eps: float = 1e-6) -> np.ndarray:
    """Advantages of one group's ``rewards``."""
    r = np.asarray(rewards, np.float64)
    mean = r.mean()
    if how == "grpo":
        return (r - mean) / (r.std() + eps)
    if how == "drgrpo":
        return r - mean
    if how == "rloo":
        n = len(r)
        return (r - (r.sum() - r) / (n - 1)) if n > 1 else np.zeros_like(r)
    raise ValueError(f"unknown advantage estimator {how!r}")


def overlong_penalty(policy_tokens: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (<= 0) for a response of ``policy_tokens``."""
    if max_tokens <= 0 or policy_tokens <= max_tokens - buffer:
        return 0.0
    if policy_tokens >= max_tokens:
        return -penalty
    return (max_tokens - buffer - policy_tokens) / buffer * penalty


def zero_variance(rewards: np.ndarray) -> bool:
    """Whether every reward of the group is the same (no learning signal)."""
    r = np.asarray(rewards, np.float64)
    return bool(np.all(r == r[0])) if len(r) else True
