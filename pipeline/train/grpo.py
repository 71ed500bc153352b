"""GRPO with off-policy correction: one jitted pure step ``(state, batch) -> (state, metrics)``.

- Advantages are group-normalised: ``(r - mean(r_group)) / (std(r_group) + eps)``.
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
- Optional KL to a frozen reference policy (k3 estimator), weighted by ``kl_coef``.

A batch is split into ``minibatches`` updates inside the step (``lax.scan``), so clipping
acts from the second update on.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from pipeline.policy.model import Transformer, token_logprobs_and_entropy
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


def group_advantages(
    rewards: jax.Array, group_ids: jax.Array, num_groups: int, eps: float
) -> jax.Array:
    """``(r - mean) / (std + eps)`` within each group (``group_ids`` in ``[0, num_groups)``)."""
    count = jax.ops.segment_sum(jnp.ones_like(rewards), group_ids, num_groups)
    mean = jax.ops.segment_sum(rewards, group_ids, num_groups) / jnp.maximum(count, 1)
    sq = jax.ops.segment_sum((rewards - mean[group_ids]) ** 2, group_ids, num_groups)
    std = jnp.sqrt(sq / jnp.maximum(count, 1))
    return (rewards - mean[group_ids]) / (std[group_ids] + eps)


def _logprobs_and_entropy(
    graphdef: Any, params: Any, tokens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    return token_logprobs_and_entropy(nnx.merge(graphdef, params), tokens)


def _aggregate(per_token: jax.Array, mask: jax.Array, how: str) -> jax.Array:
    if how == "token_mean":
        return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    rows = jnp.sum(mask, axis=1) > 0
    summed = jnp.sum(per_token * mask, axis=1)
    if how == "seq_mean_token_mean":
        summed = summed / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    return jnp.sum(summed * rows) / jnp.maximum(jnp.sum(rows), 1.0)


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
        params: Any, mb: Batch, prox: jax.Array | None, ref: jax.Array | None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        logp, entropy = _logprobs_and_entropy(graphdef, params, mb.tokens)
        if prox is None:  # one update per step: the proximal policy is this one
            prox = jax.lax.stop_gradient(logp)
        mask = mb.mask * mb.valid[:, None]
        adv = mb.advantage[:, None]
        # log-ratios are capped before exp: past the cap both branches of the clipped
        # objective are constant, so the cap changes no value or gradient, but an extreme
        # behaviour log-probability can no longer make inf (and inf * 0 = NaN gradients)
        if cfg.correction == "decoupled":
            ratio = jnp.exp(jnp.minimum(logp - prox, _MAX_LOG_RATIO))
            weight = jnp.exp(jnp.minimum(prox - mb.behaviour, jnp.log(cfg.is_cap)))
            unclipped = ratio * adv
        else:  # tis: the clipped ratio against the behaviour policy, truncated
            ratio = jnp.exp(jnp.minimum(logp - mb.behaviour, _MAX_LOG_RATIO))
            weight = jnp.ones_like(ratio)
            unclipped = jnp.minimum(ratio, cfg.is_cap) * adv
        clipped = jnp.clip(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv
        per_token = -weight * jnp.minimum(unclipped, clipped)
        n = jnp.maximum(jnp.sum(mask), 1.0)
        metrics = {}
        if ref is not None:
            kl_ref = jnp.exp(ref - logp) - (ref - logp) - 1.0  # k3, >= 0
            per_token = per_token + cfg.kl_coef * kl_ref
            metrics["kl_ref"] = jnp.sum(kl_ref * mask) / n
        loss = _aggregate(per_token, mask, cfg.aggregation)
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
            (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *mb)
            metrics["grad_norm"] = optax.tree.norm(grads)
            ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])

            def apply(args: tuple[Any, Any, Any]) -> tuple[Any, Any]:
                params, opt_state, grads = args
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state

            # an update whose loss or gradients are not finite is not made (decided before
            # the optimizer runs, so no second copy of the state is needed to undo it)
            carry = jax.lax.cond(ok, apply, lambda a: (a[0], a[1]), (params, opt_state, grads))
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
