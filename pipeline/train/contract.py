"""What a trainer accepts beyond a record's own shape: the training contract.

A record that decodes (:func:`pipeline.records.trajectory.find_violation` holds) can still be
unfit to train on: token ids outside the trainer's vocabulary gather garbage (or NaN) from
the embedding, a behaviour log-probability above 0 or absurdly low makes the importance
weight infinite, a reward of ``1e308`` overflows the group's mean, and a policy version
newer than any the trainer announced can never become stale. :class:`RecordContract`
refuses each with its own reason, which becomes the ledger's drop reason and the
dead-letter record's ``error_class``:

- ``token_range``: a token id below 0 or at or above the vocabulary size;
- ``bad_logprob``: a policy token's log-probability above 0 or below ``min_logprob``;
- ``reward_bound``: the reward or a reward component beyond ``max_abs_reward``;
- ``future_version``: a policy version newer than the newest one announced.

The checks are a few vectorised reductions over the record's arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import InvalidConfigError
from pipeline.records.trajectory import MAX_ABS_REWARD, Trajectory

#: reasons a record can be refused for by the contract (besides the decode reasons)
CONTRACT_REASONS = ("token_range", "bad_logprob", "reward_bound", "future_version")


@dataclass(frozen=True)
class RecordContract:
    """``vocab_size``: token ids must lie in ``[0, vocab_size)``. ``max_abs_reward``
    bounds every reward so that no group statistic can overflow (with groups of up to
    2**20 members, ``1e300 / 2**20`` is far from float64's limit). ``min_logprob`` is the
    lowest behaviour log-probability a sampled token may carry (float32 cannot sample a
    token rarer than about ``exp(-104)``)."""

    vocab_size: int
    max_abs_reward: float = MAX_ABS_REWARD
    min_logprob: float = -1e3

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise InvalidConfigError(f"vocab_size must be positive, got {self.vocab_size}")
        if not 0 < self.max_abs_reward <= 1e300:
            raise InvalidConfigError(
                f"max_abs_reward must be in (0, 1e300], got {self.max_abs_reward}"
            )
        if not -1e30 <= self.min_logprob < 0:
            raise InvalidConfigError(f"min_logprob must be negative, got {self.min_logprob}")

    def violation(self, t: Trajectory, newest_version: int | None) -> tuple[str, str] | None:
        """The first way ``t`` breaks the contract, as ``(reason, message)``, or None.
        ``newest_version`` is the newest policy version announced (None: no bound, as
        when training from a recording)."""
        tokens = t.tokens
        if tokens.shape[0]:
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= self.vocab_size:
                return (
                    "token_range",
                    f"token ids span [{low}, {high}], outside [0, {self.vocab_size})",
                )
            policy = t.logprobs[t.loss_mask.astype(bool)]
            if policy.shape[0]:
                lo, hi = float(policy.min()), float(policy.max())
                if hi > 0 or lo < self.min_logprob:
                    return (
                        "bad_logprob",
                        f"policy log-probabilities span [{lo:g}, {hi:g}], outside "
                        f"[{self.min_logprob:g}, 0]",
                    )
        bound = self.max_abs_reward
        if abs(t.reward) > bound or any(abs(v) > bound for v in t.rewards.values()):
            return "reward_bound", f"reward {t.reward:g} or a component exceeds {bound:g}"
        if newest_version is not None and t.max_version > newest_version:
            return (
                "future_version",
                f"policy version {t.max_version} is newer than the newest announced "
                f"({newest_version})",
            )
        return None
