"""GRPO with off-policy correction: one jitted pure step ``(state, batch) -> (state, metrics)``.

- Advantages come with the batch (:mod:`pipeline.train.advantages`: GRPO, Dr. GRPO or
  RLOO, DAPO's overlong shaping and dynamic sampling).
- Each trajectory carries the behaviour log-probabilities ``mu`` of its policy tokens
  (the producer's policy, possibly several versions old). Two corrections:

  ``decoupled`` (decoupled PPO): a proximal policy ``prox`` (the trainer's parameters at
  the start of the step) anchors the clipped ratio ``r = pi / prox`` with separate
  ``clip_low``/``clip_high``, and each token is weighted by ``min(prox / mu, is_cap)``.

  ``tis`` (truncated importance sampling): the clipped ratio is taken against the
  behaviour policy itself, ``r = pi / mu``, and its unclipped branch is truncated at
  ``is_cap``.

- Token-level aggregation: ``token_mean`` (all policy tokens of the batch weigh the same),
  ``seq_mean_token_mean`` or ``seq_mean_token_sum``.
- The ratio is per token (PPO) or per sequence (GSPO-token: each row's length-normalised
  log-ratio as every token's value, each token's own gradient); clipping with separate
  ``clip_low``/``clip_high`` (DAPO's clip-higher; equal for the symmetric PPO clip).
- Optional KL to a frozen reference policy (k1 or k3 estimator), weighted by ``kl_coef``.

A batch is split into ``minibatches`` updates inside the step (``lax.scan``), so clipping
acts from the second update on; each minibatch's gradient is accumulated over
``microbatches`` slices, normalised by the whole minibatch, so the update is the same as
computing it at once.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from pipeline.policy.model import Transformer, finite_leaves, token_logprobs_and_entropy
from pipeline.train.config import GRPOConfig

#: log-ratios above this are capped before exp (exp(20) ~ 5e8, far past any clip range)
_MAX_LOG_RATIO = 20.0


class Batch(NamedTuple):
    """A training batch of fixed shape ``[B, T]`` (``B`` rows, padded to bucket ``T``).

    ``mask`` is 1 on policy tokens; ``behaviour`` their log-probabilities when sampled;
    ``advantage`` per row; ``valid`` 0 for padding rows. Host (numpy) or device arrays.
    """

    tokens: Any
    mask: Any
    behaviour: Any
    advantage: Any
    valid: Any


class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array
    reference: Any


def _logprobs_and_entropy(
    graphdef: Any, params: Any, tokens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    return token_logprobs_and_entropy(nnx.merge(graphdef, params), tokens)


def denominators(mask: jax.Array) -> jax.Array:
    """``[policy tokens, rows with policy tokens]`` of a (mini)batch: what each
    aggregation divides by, fixed for the whole minibatch so that its micro-batches'
    gradients add up to the minibatch's own."""
    return jnp.stack([jnp.sum(mask), jnp.sum(jnp.sum(mask, axis=1) > 0)]).astype(jnp.float32)


def _aggregate(per_token: jax.Array, mask: jax.Array, how: str, denom: jax.Array) -> jax.Array:
    """``token_mean``: every policy token of the minibatch weighs the same;
    ``seq_mean_token_mean``: every row the same, its tokens averaged;
    ``seq_mean_token_sum``: every row the same, its tokens summed (Dr.GRPO)."""
    if how == "token_mean":
        return jnp.sum(per_token * mask) / jnp.maximum(denom[0], 1.0)
    summed = jnp.sum(per_token * mask, axis=1)
    if how == "seq_mean_token_mean":
        summed = summed / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    return jnp.sum(summed) / jnp.maximum(denom[1], 1.0)


def _sequence_log_ratio(log_ratio: jax.Array, logp: jax.Array, mask: jax.Array) -> jax.Array:
    """GSPO-token: every token of a row carries the row's length-normalised log-ratio as
    its value, and its own token's gradient."""
    seq = jnp.sum(log_ratio * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    return jax.lax.stop_gradient(seq)[:, None] + logp - jax.lax.stop_gradient(logp)


def make_train_step(
    graphdef: Any,
    cfg: GRPOConfig,
    tx: optax.GradientTransformation,
    donate: bool = False,
    shardings: tuple[Any, Any] | None = None,
) -> Any:
    """The jitted ``train_step(state, batch) -> (state, metrics)``. With ``donate`` the
    state passed in is consumed (its buffers hold the new one), so a step needs memory
    for one state, not two; the caller must not use it again. ``shardings`` (the
    state's and the batch's, :mod:`pipeline.train.mesh`) make it one SPMD step over a
    device mesh, the state keeping its layout from step to step."""
    jit_args: dict[str, Any] = {"donate_argnums": (0,) if donate else ()}
    if shardings is not None:
        state_sh, batch_sh = shardings
        replicated = NamedSharding(batch_sh.mesh, PartitionSpec())
        jit_args |= {"in_shardings": (state_sh, batch_sh), "out_shardings": (state_sh, replicated)}

    def loss_fn(
        params: Any, mb: Batch, prox: jax.Array | None, ref: jax.Array | None, denom: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        logp, entropy = _logprobs_and_entropy(graphdef, params, mb.tokens)
        if prox is None:  # one update per step: the proximal policy is this one
            prox = jax.lax.stop_gradient(logp)
        mask = mb.mask * mb.valid[:, None]
        adv = mb.advantage[:, None]
        anchor = prox if cfg.correction == "decoupled" else mb.behaviour
        log_ratio = logp - anchor
        if cfg.ratio == "sequence":
            log_ratio = _sequence_log_ratio(log_ratio, logp, mask)
        # log-ratios are capped before exp: past the cap both branches of the clipped
        # objective are constant, so the cap changes no value or gradient, but an extreme
        # behaviour log-probability can no longer make inf (and inf * 0 = NaN gradients)
        ratio = jnp.exp(jnp.minimum(log_ratio, _MAX_LOG_RATIO))
        if cfg.correction == "decoupled":
            weight = jnp.exp(jnp.minimum(prox - mb.behaviour, jnp.log(cfg.is_cap)))
            unclipped = ratio * adv
        else:  # tis: the clipped ratio against the behaviour policy, truncated
            weight = jnp.ones_like(ratio)
            unclipped = jnp.minimum(ratio, cfg.is_cap) * adv
        clipped = jnp.clip(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv
        per_token = -weight * jnp.minimum(unclipped, clipped)
        n = jnp.maximum(jnp.sum(mask), 1.0)
        metrics = {}
        if ref is not None:
            if cfg.kl_estimator == "k1":
                kl_ref = logp - ref
            else:  # k3: unbiased and never negative
                kl_ref = jnp.exp(ref - logp) - (ref - logp) - 1.0
            per_token = per_token + cfg.kl_coef * kl_ref
            metrics["kl_ref"] = jnp.sum(kl_ref * mask) / n
        loss = _aggregate(per_token, mask, cfg.aggregation, denom)
        is_w = jnp.exp(jnp.minimum(prox - mb.behaviour, _MAX_LOG_RATIO))
        metrics |= {
            "loss": loss,
            "clip_fraction": jnp.sum((clipped < unclipped) * mask) / n,
            "entropy": jnp.sum(entropy * mask) / n,
            "kl_behaviour": jnp.sum((mb.behaviour - prox) * mask) / n,
            "is_weight_mean": jnp.sum(is_w * mask) / n,
            "is_weight_max": jnp.max(jnp.where(mask > 0, is_w, 0.0)),
            "is_truncated_fraction": jnp.sum((is_w > cfg.is_cap) * mask) / n,
        }
        return loss, metrics

    def gradients(params: Any, mb: Any) -> tuple[dict[str, jax.Array], Any]:
        """The minibatch's loss gradients, accumulated over ``cfg.microbatches`` slices
        of its rows (each normalised by the whole minibatch, so the sum is exact)."""
        batch, prox, ref = mb
        denom = denominators(batch.mask * batch.valid[:, None])
        k = cfg.microbatches
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if k == 1:
            (_, metrics), grads = grad_fn(params, batch, prox, ref, denom)
            return metrics, grads
        micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), mb)

        def accumulate(total: Any, one: Any) -> tuple[Any, Any]:
            (_, metrics), grads = grad_fn(params, *one, denom)
            return jax.tree.map(jnp.add, total, grads), metrics

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, metrics = jax.lax.scan(accumulate, zeros, micro)
        # the loss is one normalised sum in k parts; the other metrics are averaged
        reduce: dict[str, Any] = {"loss": jnp.sum, "is_weight_max": jnp.max}
        return {n: reduce.get(n, jnp.mean)(v) for n, v in metrics.items()}, grads

    @functools.partial(jax.jit, **jit_args)
    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        # Forward passes only where they are needed: with one update per step the
        # proximal log-probabilities are the update's own (computed in the loss), and
        # the reference policy only matters with a KL term.
        prox = ref = None
        if cfg.minibatches > 1:
            prox = jax.lax.stop_gradient(
                _logprobs_and_entropy(graphdef, state.params, batch.tokens)[0]
            )
        if cfg.kl_coef:
            if state.reference is None:
                raise ValueError("a KL term needs a state made with a reference policy")
            ref = _logprobs_and_entropy(graphdef, state.reference, batch.tokens)[0]
        m = cfg.minibatches
        split = jax.tree.map(
            lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), (batch, prox, ref)
        )

        def update(carry: tuple[Any, Any], mb: Any) -> tuple[tuple[Any, Any], Any]:
            params, opt_state = carry
            metrics, grads = gradients(params, mb)
            metrics["grad_norm"] = optax.tree.norm(grads)
            ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])

            def apply(args: tuple[Any, Any, Any]) -> tuple[Any, Any]:
                params, opt_state, grads = args
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state

            def stays_finite(args: tuple[Any, Any, Any]) -> jax.Array:
                return finite_leaves(apply(args)[0])

            # An update is made only if its loss, its gradients and the parameters it
            # would make are all finite, decided before anything is written: the check
            # runs the optimizer once without keeping its result (XLA fuses it leaf by
            # leaf), so no second copy of the state is needed to undo an update.
            args = (params, opt_state, grads)
            ok = jax.lax.cond(ok, stays_finite, lambda a: jnp.asarray(False), args)
            carry = jax.lax.cond(ok, apply, lambda a: (a[0], a[1]), args)
            metrics["finite"] = ok
            return carry, metrics

        (params, opt_state), metrics = jax.lax.scan(update, (state.params, state.opt_state), split)
        applied = jnp.all(metrics.pop("finite"))
        metrics = jax.tree.map(jnp.mean, metrics)
        metrics["applied"] = applied.astype(jnp.float32)
        step = state.step + applied.astype(state.step.dtype)
        if m > 1:
            # all or nothing: minibatches before a non-finite one are undone too (this
            # keeps the step's starting state alive, twice the memory of one update)
            params, opt_state = jax.tree.map(
                lambda a, b: jnp.where(applied, a, b),
                (params, opt_state),
                (state.params, state.opt_state),
            )
        return TrainState(params, opt_state, step, state.reference), metrics

    return train_step


def init_state(
    model: Transformer, tx: optax.GradientTransformation, reference: bool = True
) -> tuple[Any, TrainState]:
    """The model's graph definition and a fresh training state; with ``reference`` the
    initial parameters are kept as the KL term's reference (a second copy of the model
    once training moves them, so leave it out when there is no KL term)."""
    graphdef, params = nnx.split(model)
    ref = params if reference else None
    return graphdef, TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), ref)
