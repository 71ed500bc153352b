"""GRPO with off-policy correction: one jitted pure step ``(state, batch) -> (state, metrics)``.

The loss (the corrections, ratios, aggregations and KL term) is
:mod:`pipeline.train.objective`'s; this module runs it over the model:

- With LoRA (:mod:`pipeline.policy.lora`) the state's ``params`` are the frozen base and
  its ``adapters`` are what is trained: the policy is the base with the adapters merged
  in, the optimizer's state covers the adapters alone, and the base is the KL term's
  reference (no second copy).
- PPO's critic (``advantage: gae``): a value head on the policy's hidden states, its
  advantages computed inside the step (:mod:`pipeline.train.critic`).

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

from pipeline.policy.config import LoRAConfig
from pipeline.policy.lora import init_adapters, merged
from pipeline.policy.model import (
    Transformer,
    finite_leaves,
    token_logprobs_and_entropy,
    token_logprobs_entropy_features,
)
from pipeline.train.config import GRPOConfig
from pipeline.train.critic import gae, init_critic
from pipeline.train.critic import values as critic_values
from pipeline.train.objective import (
    PER_TOKEN_METRICS,
    Batch,
    critic_loss,
    denominators,
    policy_loss,
)


class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array
    reference: Any
    #: the value head's parameters (PPO, ``advantage: gae``), else None; with a critic
    #: the optimizer's state covers ``(params, critic)``
    critic: Any = None
    #: LoRA adapters (then ``params`` is the frozen base, and the optimizer's state
    #: covers the adapters in place of the parameters), else None
    adapters: Any = None

    @property
    def trained(self) -> Any:
        """What the optimizer moves: the adapters with LoRA, else the parameters."""
        return self.params if self.adapters is None else self.adapters


def _logprobs_and_entropy(
    graphdef: Any, params: Any, b: Batch, temperature: float
) -> tuple[jax.Array, jax.Array]:
    return token_logprobs_and_entropy(
        nnx.merge(graphdef, params), b.tokens, temperature, b.position, b.segment
    )


def _forward(
    graphdef: Any, params: Any, critic: Any, b: Batch, temperature: float
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Log-probabilities (under the sampling temperature), entropies and (with a critic)
    values of every token."""
    if critic is None:
        return (*_logprobs_and_entropy(graphdef, params, b, temperature), None)
    logp, entropy, hidden = token_logprobs_entropy_features(
        nnx.merge(graphdef, params), b.tokens, temperature, b.position, b.segment
    )
    return logp, entropy, critic_values(critic, hidden)


def _advantages_from_critic(
    cfg: GRPOConfig, value: jax.Array, b: Batch
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GAE advantages (whitened over the batch's policy tokens), value targets, steps."""
    adv, target, steps = gae(
        value, b.reward, b.mask, b.segment, cfg.credit, cfg.gamma, cfg.gae_lambda
    )
    n = jnp.maximum(jnp.sum(b.mask), 1.0)
    mean = jnp.sum(adv * b.mask) / n
    std = jnp.sqrt(jnp.sum(((adv - mean) * b.mask) ** 2) / n)
    return (adv - mean) / (std + cfg.adv_eps) * b.mask, target, steps


def _micro_reduce(name: str, parts: jax.Array) -> jax.Array:
    """A minibatch's metric from its micro-batches' ``[k, ...]``."""
    if name in PER_TOKEN_METRICS:
        return parts.reshape(-1, parts.shape[-1])
    return jnp.max(parts) if name == "is_weight_max" else jnp.sum(parts)


def make_train_step(
    graphdef: Any,
    cfg: GRPOConfig,
    tx: optax.GradientTransformation,
    donate: bool = False,
    shardings: tuple[Any, Any] | None = None,
    lora: LoRAConfig | None = None,
) -> Any:
    """The jitted ``train_step(state, batch) -> (state, metrics)``. With ``donate`` the
    state passed in is consumed (its buffers hold the new one), so a step needs memory
    for one state, not two; the caller must not use it again. ``shardings`` (the
    state's and the batch's, :mod:`pipeline.train.mesh`) make it one SPMD step over a
    device mesh, the state keeping its layout from step to step. ``lora``: the adapters'
    settings, for a state made with them."""
    jit_args: dict[str, Any] = {"donate_argnums": (0,) if donate else ()}
    if shardings is not None:
        state_sh, batch_sh = shardings
        replicated = NamedSharding(batch_sh.mesh, PartitionSpec())
        jit_args |= {"in_shardings": (state_sh, batch_sh), "out_shardings": (state_sh, replicated)}
    scale = lora.scale if lora is not None else 0.0

    def policy(base: Any, weights: Any) -> Any:
        """The policy's parameters: ``weights``, or the adapters merged into ``base``."""
        return weights if base is None else merged(base, weights, scale)

    def loss_fn(
        trainable: Any,
        mb: Batch,
        prox: jax.Array | None,
        ref: jax.Array | None,
        valued: Any,
        denom: jax.Array,
        n: int,
        base: Any,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        weights, critic = trainable
        logp, entropy, value = _forward(
            graphdef, policy(base, weights), critic, mb, cfg.temperature
        )
        if prox is None:  # one update per step: the proximal policy is this one
            prox = jax.lax.stop_gradient(logp)
        loss, metrics = policy_loss(cfg, logp, prox, mb, ref, denom, n)
        tokens = jnp.maximum(denom[0], 1.0)
        metrics["entropy"] = jnp.sum(entropy * mb.mask) / tokens
        if value is not None:  # PPO's critic: squared error to the GAE targets
            target, steps = valued
            value_loss = critic_loss(value, target, steps, denom)
            loss = loss + cfg.value_coef * value_loss
            metrics["value_loss"] = value_loss
        metrics["loss"] = loss
        return loss, metrics

    def gradients(trainable: Any, mb: Any, n: int, base: Any) -> tuple[dict[str, jax.Array], Any]:
        """The minibatch's loss gradients, accumulated over ``cfg.microbatches`` slices
        of its rows (each normalised by the whole minibatch, so the sum is exact). A
        sequence never spans rows, so no slice splits one."""
        batch, prox, ref, valued = mb
        steps = valued[1] if valued is not None else None
        denom = denominators(batch.mask, batch.segment, n, steps)
        k = cfg.microbatches
        grad_fn = jax.value_and_grad(functools.partial(loss_fn, n=n, base=base), has_aux=True)
        if k == 1:
            (_, metrics), grads = grad_fn(trainable, batch, prox, ref, valued, denom)
            return metrics, grads
        micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), mb)

        def accumulate(total: Any, one: Any) -> tuple[Any, Any]:
            (_, metrics), grads = grad_fn(trainable, *one, denom)
            return jax.tree.map(jnp.add, total, grads), metrics

        zeros = jax.tree.map(jnp.zeros_like, trainable)
        grads, metrics = jax.lax.scan(accumulate, zeros, micro)
        # every metric is one sum normalised by the minibatch, in k parts (the largest
        # weight is the largest of the parts'); a per-token one is the parts' rows again
        return {n: _micro_reduce(n, v) for n, v in metrics.items()}, grads

    @functools.partial(jax.jit, **jit_args)
    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        # Forward passes only where they are needed: with one update per step the
        # proximal log-probabilities are the update's own (computed in the loss), and
        # the reference policy only matters with a KL term.
        batch = batch.per_token()
        n = batch.tokens.size  # a bound on the batch's segment ids
        prox = ref = valued = None
        base = None if state.adapters is None else state.params
        if base is not None and lora is None:
            raise ValueError("a state with LoRA adapters needs make_train_step(..., lora=)")
        if cfg.minibatches > 1 or state.critic is not None:
            logp0, _, value0 = _forward(
                graphdef, policy(base, state.trained), state.critic, batch, cfg.temperature
            )
            if cfg.minibatches > 1:
                prox = jax.lax.stop_gradient(logp0)
            if value0 is not None:
                adv, target, steps = jax.lax.stop_gradient(
                    _advantages_from_critic(cfg, value0, batch)
                )
                batch = batch._replace(advantage=adv)
                valued = (target, steps)
        if cfg.kl_coef:
            reference = state.reference if base is None else base
            if reference is None:
                raise ValueError("a KL term needs a state made with a reference policy")
            ref = _logprobs_and_entropy(graphdef, reference, batch, cfg.temperature)[0]
        m = cfg.minibatches
        split = jax.tree.map(
            lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), (batch, prox, ref, valued)
        )
        with_critic = state.critic is not None

        def update(carry: tuple[Any, Any], mb: Any) -> tuple[tuple[Any, Any], Any]:
            trainable, opt_state = carry
            metrics, grads = gradients(trainable, mb, n, base)
            if not with_critic:  # the optimizer's state covers the policy alone
                trainable, grads = trainable[0], grads[0]
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
            args = (trainable, opt_state, grads)
            ok = jax.lax.cond(ok, stays_finite, lambda a: jnp.asarray(False), args)
            trainable, opt_state = jax.lax.cond(ok, apply, lambda a: (a[0], a[1]), args)
            if not with_critic:
                trainable = (trainable, None)
            metrics["finite"] = ok
            return (trainable, opt_state), metrics

        start = ((state.trained, state.critic), state.opt_state)
        ((trained, critic), opt_state), metrics = jax.lax.scan(update, start, split)
        applied = jnp.all(metrics.pop("finite"))
        # each minibatch's share of the batch; a per-token metric, its rows in batch order
        metrics = {
            n: v.reshape(-1, v.shape[-1]) if n in PER_TOKEN_METRICS else jnp.mean(v)
            for n, v in metrics.items()
        }
        metrics["applied"] = applied.astype(jnp.float32)
        step = state.step + applied.astype(state.step.dtype)
        if m > 1:
            # all or nothing: minibatches before a non-finite one are undone too (this
            # keeps the step's starting state alive, twice the memory of one update)
            trained, critic, opt_state = jax.tree.map(
                lambda a, b: jnp.where(applied, a, b),
                (trained, critic, opt_state),
                (state.trained, state.critic, state.opt_state),
            )
        if base is not None:
            return state._replace(
                opt_state=opt_state, step=step, critic=critic, adapters=trained
            ), metrics
        return TrainState(trained, opt_state, step, state.reference, critic), metrics

    return train_step


def init_state(
    model: Transformer,
    tx: optax.GradientTransformation,
    reference: bool = True,
    critic: bool = False,
    lora: LoRAConfig | None = None,
    seed: int = 0,
) -> tuple[Any, TrainState]:
    """The model's graph definition and a fresh training state; with ``reference`` the
    initial parameters are kept as the KL term's reference (a second copy of the model
    once training moves them, so leave it out when there is no KL term); with
    ``critic`` a value head (PPO); with ``lora`` (rank > 0) adapters made from ``seed``,
    trained in place of the parameters (which then serve as the reference)."""
    graphdef, params = nnx.split(model)
    adapters = None
    if lora is not None and lora.rank:
        adapters = init_adapters(model.cfg, lora, seed)
        reference = False
    # a copy of its own: a donated state must not hold one buffer twice
    ref = jax.tree.map(jnp.copy, params) if reference else None
    trained = params if adapters is None else adapters
    step = jnp.zeros((), jnp.int32)
    head = init_critic(model.cfg.d_model) if critic else None
    opt_state = tx.init(trained if head is None else (trained, head))
    return graphdef, TrainState(params, opt_state, step, ref, head, adapters)
