"""PPO's critic: a value head on the policy's hidden states, and generalised advantage
estimation (GAE) inside the jitted step.

The value of the state before token ``t`` is ``w . h + b`` on the hidden state ``h``
token ``t`` was predicted from (the head shares the policy's trunk, as a causal LM "with
a value head" does; its gradient reaches the trunk through ``value_coef``). The critic's
parameters are trained and checkpointed with the policy's and never announced.

Rewards come per token: a trajectory's reward (with overlong shaping) on its last policy
token. GAE runs over *steps* of each sequence, backwards from its end:

- ``credit="token"``: every policy token is a step (tokens of the environment between
  turns are skipped, not steps);
- ``credit="turn"``: every policy turn is a step, valued at its first token; the turn's
  advantage is every one of its tokens' (turn-level credit for multi-turn episodes).

``delta_k = r_k + gamma * V_{k+1} - V_k`` (``V`` past the last step is 0) and
``A_k = delta_k + gamma * lambda * A_{k+1}``; the value target of step ``k`` is
``A_k + V_k``. Segments of a packed row are independent sequences.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def init_critic(d_model: int) -> dict[str, jax.Array]:
    """A value head that predicts 0 everywhere at first."""
    return {"w": jnp.zeros((d_model,), jnp.float32), "b": jnp.zeros((), jnp.float32)}


def values(critic: Any, hidden: jax.Array) -> jax.Array:
    """``[B, T]`` values from the hidden states ``[B, T, d]`` (in float32)."""
    return hidden.astype(jnp.float32) @ critic["w"] + critic["b"]


def steps(mask: jax.Array, segment: jax.Array, credit: str) -> jax.Array:
    """1 where a GAE step is valued: every policy token, or the first of each turn."""
    if credit == "token":
        return mask
    before = jnp.pad(mask[:, :-1], ((0, 0), (1, 0)))
    same = jnp.pad(segment[:, 1:] == segment[:, :-1], ((0, 0), (1, 0)))
    return mask * (1.0 - before * same)


def gae(
    value: jax.Array,
    reward: jax.Array,
    mask: jax.Array,
    segment: jax.Array,
    credit: str,
    gamma: float,
    lam: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(advantage [B, T] on policy tokens, value target [B, T] on steps, steps [B, T])``
    from ``value`` and the per-token ``reward`` (all ``[B, T]``, no gradient)."""
    step = steps(mask, segment, credit)
    # a sequence starts where the segment id changes; scanning backwards, it ends there
    new = jnp.pad(segment[:, 1:] != segment[:, :-1], ((0, 0), (0, 1)), constant_values=True)

    def back(carry: Any, x: Any) -> Any:
        next_v, next_a, pending = carry
        v, r, m, s, last = x
        next_v, next_a, pending = (jnp.where(last, 0.0, c) for c in (next_v, next_a, pending))
        pending = pending + r * m
        delta = pending + gamma * next_v - v
        a = delta + gamma * lam * next_a
        on = s > 0
        carry = (
            jnp.where(on, v, next_v),
            jnp.where(on, a, next_a),
            jnp.where(on, 0.0, pending),
        )
        return carry, jnp.where(on, a, 0.0)

    zeros = jnp.zeros(value.shape[0], jnp.float32)
    xs = tuple(a.T[::-1] for a in (value, reward, mask, step, new))
    _, adv_at_steps = jax.lax.scan(back, (zeros, zeros, zeros), xs)
    adv_at_steps = adv_at_steps[::-1].T

    # forwards: every policy token takes the advantage of the step it belongs to
    first = jnp.pad(segment[:, 1:] != segment[:, :-1], ((0, 0), (1, 0)), constant_values=True)

    def forth(cur: jax.Array, x: Any) -> Any:
        a, m, s, start = x
        cur = jnp.where(start, 0.0, cur)
        cur = jnp.where(s > 0, a, cur)
        return cur, cur * m

    xs2 = tuple(a.T for a in (adv_at_steps, mask, step, first))
    _, adv = jax.lax.scan(forth, zeros, xs2)
    return adv.T, (adv_at_steps + value) * step, step
