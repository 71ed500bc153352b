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

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from pipeline.errors import InvalidConfigError
from pipeline.model import Transformer


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Loss and optimiser settings."""

    learning_rate: float = 3e-4
    warmup_steps: int = 5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    is_cap: float = 2.0
    correction: str = "decoupled"
    aggregation: str = "token_mean"
    kl_coef: float = 0.0
    minibatches: int = 1
    adv_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.correction not in ("decoupled", "tis"):
            raise InvalidConfigError(f"correction must be decoupled or tis, not {self.correction}")
        aggs = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
        if self.aggregation not in aggs:
            raise InvalidConfigError(f"aggregation must be one of {aggs}")
        if self.minibatches < 1 or self.is_cap <= 0:
            raise InvalidConfigError("minibatches must be >= 1 and is_cap > 0")

    def optimizer(self) -> optax.GradientTransformation:
        schedule = optax.linear_schedule(0.0, self.learning_rate, max(1, self.warmup_steps))
        return optax.chain(
            optax.clip_by_global_norm(self.max_grad_norm),
            optax.adamw(schedule, weight_decay=self.weight_decay),
        )


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
    model: Transformer = nnx.merge(graphdef, params)
    b, t = tokens.shape
    logits, _ = model(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)))
    logp_all = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    pad = jnp.zeros((b, 1), jnp.float32)
    return jnp.concatenate([pad, picked], 1), jnp.concatenate([pad, entropy], 1)


def _aggregate(per_token: jax.Array, mask: jax.Array, how: str) -> jax.Array:
    if how == "token_mean":
        return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    rows = jnp.sum(mask, axis=1) > 0
    summed = jnp.sum(per_token * mask, axis=1)
    if how == "seq_mean_token_mean":
        summed = summed / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    return jnp.sum(summed * rows) / jnp.maximum(jnp.sum(rows), 1.0)


def make_train_step(graphdef: Any, cfg: GRPOConfig, tx: optax.GradientTransformation) -> Any:
    """The jitted ``train_step(state, batch) -> (state, metrics)``."""

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

    @jax.jit
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
            ref = _logprobs_and_entropy(graphdef, state.reference, batch.tokens)[0]
        m = cfg.minibatches
        split = jax.tree.map(
            lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), (batch, prox, ref)
        )

        def update(carry: tuple[Any, Any], mb: Any) -> tuple[tuple[Any, Any], Any]:
            params, opt_state = carry
            (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *mb)
            updates, opt_state = tx.update(grads, opt_state, params)
            metrics["grad_norm"] = optax.tree.norm(grads)
            return (optax.apply_updates(params, updates), opt_state), metrics

        (params, opt_state), metrics = jax.lax.scan(update, (state.params, state.opt_state), split)
        # A step whose loss, gradients or new parameters are not all finite is not
        # applied: the state is returned unchanged and ``applied`` says so.
        applied = jnp.logical_and(
            jnp.all(jnp.isfinite(metrics["loss"])) & jnp.all(jnp.isfinite(metrics["grad_norm"])),
            _all_finite(params),
        )
        metrics = jax.tree.map(jnp.mean, metrics)
        metrics["applied"] = applied.astype(jnp.float32)
        new = TrainState(params, opt_state, state.step + 1, state.reference)
        return jax.tree.map(lambda a, b: jnp.where(applied, a, b), new, state), metrics

    return train_step


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def all_finite(tree: Any) -> bool:
    """Whether every floating-point leaf of ``tree`` is finite (on the host)."""
    return bool(
        _all_finite(
            [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
        )
    )


def init_state(model: Transformer, tx: optax.GradientTransformation) -> tuple[Any, TrainState]:
    """The model's graph definition and a fresh training state (reference = initial)."""
    graphdef, params = nnx.split(model)
    return graphdef, TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), params)
