"""The policy's loss, a pure function of the current log-probabilities of a batch's tokens.

- Advantages come with the batch (:mod:`pipeline.train.advantages`: GRPO, Dr. GRPO or
  RLOO, DAPO's overlong shaping and dynamic sampling).
- Each trajectory carries the behaviour log-probabilities ``mu`` of its policy tokens
  (the producer's policy, possibly several versions old). Three corrections:

  ``decoupled`` (decoupled PPO): a proximal policy ``prox`` (the trainer's parameters at
  the start of the step) anchors the clipped ratio ``r = pi / prox`` with separate
  ``clip_low``/``clip_high``, and each token is weighted by ``min(prox / mu, is_cap)``.

  ``tis`` (truncated importance sampling): the clipped ratio is taken against the
  behaviour policy itself, ``r = pi / mu``, and its unclipped branch is truncated at
  ``is_cap``.

  ``none`` (the baseline of the staleness ablation): the clipped ratio against the
  proximal policy and no importance weight, as if every sample were the trainer's own.

- Token-level aggregation: ``token_mean`` (all policy tokens of the batch weigh the same),
  ``seq_mean_token_mean`` or ``seq_mean_token_sum``.
- The ratio is per token (PPO) or per sequence (GSPO-token: each row's length-normalised
  log-ratio as every token's value, each token's own gradient); clipping with separate
  ``clip_low``/``clip_high`` (DAPO's clip-higher; equal for the symmetric PPO clip).
- Optional KL to a frozen reference policy (k1 or k3 estimator), weighted by ``kl_coef``.
- PPO's value loss: half the squared error to the GAE targets.

Each is held to a float64 numpy implementation of the papers' formulas, loss and gradient,
in ``tests/unit/test_objective_reference.py``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pipeline.train.config import GRPOConfig

#: log-ratios above this are capped before exp (exp(20) ~ 5e8, far past any clip range)
_MAX_LOG_RATIO = 20.0

#: metrics of every token ``[B, T]`` rather than of the batch: ``sampler_log_ratio`` is
#: the trainer's log-probability minus the sampler's on each token the trainer's own
#: version sampled (NaN elsewhere), the logprob-parity check (:mod:`pipeline.train.parity`)
PER_TOKEN_METRICS = ("sampler_log_ratio",)


class Batch(NamedTuple):
    """A training batch of fixed shape ``[B, T]``. Host (numpy) or device arrays.

    ``mask`` is 1 on policy tokens; ``behaviour`` their log-probabilities when sampled;
    ``advantage`` per row ``[B]`` or per token ``[B, T]``; ``valid`` 0 for padding rows.
    Without ``segment`` each row is one sequence padded to the bucket ``T``; a packed
    batch holds several per row: ``segment [B, T]`` names each token's sequence (ids
    unique in the whole batch, below ``B * T``) and ``position [B, T]`` restarts at 0 in
    each (:func:`pipeline.train.batching.pack`).
    """

    tokens: Any
    mask: Any
    behaviour: Any
    advantage: Any
    valid: Any
    segment: Any = None
    position: Any = None
    #: per token (PPO with a critic): each trajectory's reward on its last policy token
    reward: Any = None
    #: per token: 1 where the trainer's own version sampled it (its sampler and trainer
    #: log-probabilities must agree: :data:`PER_TOKEN_METRICS`), else None
    fresh: Any = None

    def per_token(self) -> Batch:
        """The same batch with a segment and position for every token, the advantage per
        token and padding rows folded into the mask: the one form the loss reads (a row
        without segments is the segment ``row * T``)."""
        b, t = self.tokens.shape
        segment, position = self.segment, self.position
        if segment is None:
            segment = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None] * t, (b, t))
            position = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        adv = self.advantage
        if adv.ndim == 1:
            adv = jnp.broadcast_to(adv[:, None], (b, t))
        mask = self.mask * self.valid[:, None]
        return Batch(
            self.tokens,
            mask,
            self.behaviour,
            adv,
            self.valid,
            segment,
            position,
            self.reward,
            self.fresh,
        )


def _per_sequence(x: jax.Array, segment: jax.Array, n: int) -> jax.Array:
    """``x [B, T]`` summed over each sequence: ``[n]`` indexed by segment id."""
    return jax.ops.segment_sum(x.reshape(-1), segment.reshape(-1), num_segments=n)


def denominators(
    mask: jax.Array, segment: jax.Array, n: int, steps: jax.Array | None = None
) -> jax.Array:
    """``[policy tokens, sequences with policy tokens, critic steps]`` of a (mini)batch:
    what each aggregation divides by, fixed for the whole minibatch so that its
    micro-batches' gradients add up to the minibatch's own."""
    seqs = jnp.sum(_per_sequence(mask, segment, n) > 0)
    valued = jnp.sum(steps) if steps is not None else jnp.zeros(())
    return jnp.stack([jnp.sum(mask), seqs, valued]).astype(jnp.float32)


def _aggregate(per_token: jax.Array, b: Batch, how: str, denom: jax.Array, n: int) -> jax.Array:
    """``token_mean``: every policy token of the minibatch weighs the same;
    ``seq_mean_token_mean``: every sequence the same, its tokens averaged;
    ``seq_mean_token_sum``: every sequence the same, its tokens summed (Dr.GRPO)."""
    if how == "token_mean":
        return jnp.sum(per_token * b.mask) / jnp.maximum(denom[0], 1.0)
    summed = _per_sequence(per_token * b.mask, b.segment, n)
    if how == "seq_mean_token_mean":
        summed = summed / jnp.maximum(_per_sequence(b.mask, b.segment, n), 1.0)
    return jnp.sum(summed) / jnp.maximum(denom[1], 1.0)


def _sequence_log_ratio(log_ratio: jax.Array, logp: jax.Array, b: Batch, n: int) -> jax.Array:
    """GSPO-token: every token of a sequence carries the sequence's length-normalised
    log-ratio as its value, and its own token's gradient."""
    total = _per_sequence(log_ratio * b.mask, b.segment, n)
    seq = (total / jnp.maximum(_per_sequence(b.mask, b.segment, n), 1.0))[b.segment]
    return jax.lax.stop_gradient(seq) + logp - jax.lax.stop_gradient(logp)


def policy_loss(
    cfg: GRPOConfig,
    logp: jax.Array,
    prox: jax.Array,
    mb: Batch,
    ref: jax.Array | None,
    denom: jax.Array,
    n: int,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The policy's loss of a (minibatch in per-token form, :meth:`Batch.per_token`) from
    the current log-probabilities ``logp`` of its tokens, the proximal policy's ``prox``
    (no gradient) and the behaviour policy's (``mb.behaviour``); ``ref``, the reference
    policy's for the KL term (None: none). Its gradient reaches the parameters through
    ``logp`` alone. Returns the loss and its metrics (the minibatch's share of them)."""
    mask, adv = mb.mask, mb.advantage
    anchor = mb.behaviour if cfg.correction == "tis" else prox
    log_ratio = logp - anchor
    if cfg.ratio == "sequence":
        log_ratio = _sequence_log_ratio(log_ratio, logp, mb, n)
    # log-ratios are capped before exp: past the cap both branches of the clipped
    # objective are constant, so the cap changes no value or gradient, but an extreme
    # behaviour log-probability can no longer make inf (and inf * 0 = NaN gradients)
    ratio = jnp.exp(jnp.minimum(log_ratio, _MAX_LOG_RATIO))
    if cfg.correction == "decoupled":
        weight = jnp.exp(jnp.minimum(prox - mb.behaviour, jnp.log(cfg.is_cap)))
        unclipped = ratio * adv
    elif cfg.correction == "none":
        weight = jnp.ones_like(ratio)
        unclipped = ratio * adv
    else:  # tis: the clipped ratio against the behaviour policy, truncated
        weight = jnp.ones_like(ratio)
        unclipped = jnp.minimum(ratio, cfg.is_cap) * adv
    clipped = jnp.clip(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv
    per_token = -weight * jnp.minimum(unclipped, clipped)
    # the minibatch's policy tokens: a micro-batch's metrics are its share of them
    tokens = jnp.maximum(denom[0], 1.0)
    metrics = {}
    if ref is not None:
        if cfg.kl_estimator == "k1":
            kl_ref = logp - ref
        else:  # k3: unbiased and never negative
            kl_ref = jnp.exp(ref - logp) - (ref - logp) - 1.0
        per_token = per_token + cfg.kl_coef * kl_ref
        metrics["kl_ref"] = jnp.sum(kl_ref * mask) / tokens
    is_w = jnp.exp(jnp.minimum(prox - mb.behaviour, _MAX_LOG_RATIO))
    metrics |= {
        "clip_fraction": jnp.sum((clipped < unclipped) * mask) / tokens,
        "kl_behaviour": jnp.sum((mb.behaviour - prox) * mask) / tokens,
        "is_weight_mean": jnp.sum(is_w * mask) / tokens,
        "is_weight_max": jnp.max(jnp.where(mask > 0, is_w, 0.0)),
        "is_truncated_fraction": jnp.sum((is_w > cfg.is_cap) * mask) / tokens,
    }
    if mb.fresh is not None:  # prox is the trainer's policy at the start of the step
        same = (mb.fresh * mask) > 0
        metrics["sampler_log_ratio"] = jnp.where(same, prox - mb.behaviour, jnp.nan)
    return _aggregate(per_token, mb, cfg.aggregation, denom, n), metrics


def critic_loss(
    value: jax.Array, target: jax.Array, steps: jax.Array, denom: jax.Array
) -> jax.Array:
    """PPO's value loss: half the squared error to the (fixed) GAE targets, averaged over
    the minibatch's valued steps."""
    return 0.5 * jnp.sum((value - target) ** 2 * steps) / jnp.maximum(denom[2], 1)
