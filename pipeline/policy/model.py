"""The policy: a decoder-only transformer in Flax NNX with a key-value cache.

One forward function serves training (a full causal pass over ``[B, T]``) and sampling
(chunks of new tokens appended to a per-row cache at each row's own position), so the
log-probabilities a producer records are computed by exactly the code the trainer
differentiates.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pipeline.policy.config import ModelConfig


class KVCache(NamedTuple):
    """Keys and values, one array per layer, each ``[batch, heads, max_len, head_dim]``."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, dtype: Any = jnp.float32) -> KVCache:
        shape = (batch, cfg.num_heads, cfg.max_len, cfg.head_dim)
        layers = range(cfg.num_layers)
        return cls(
            tuple(jnp.zeros(shape, dtype) for _ in layers),
            tuple(jnp.zeros(shape, dtype) for _ in layers),
        )


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.norm1 = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.qkv = nnx.Linear(cfg.d_model, 3 * cfg.d_model, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(cfg.d_model, cfg.d_model, use_bias=False, rngs=rngs)
        self.norm2 = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.up = nnx.Linear(cfg.d_model, cfg.d_ff, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model, use_bias=False, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        k_cache: jax.Array | None,
        v_cache: jax.Array | None,
        write: jax.Array | None,
    ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        cfg = self.cfg
        b, t, _ = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(b, t, cfg.num_heads, cfg.head_dim)
        v = v.reshape(b, t, cfg.num_heads, cfg.head_dim)
        q, k = rope(q, positions), rope(k, positions)
        # heads before positions ([B, H, T, D]): attention needs no transpose of the cache
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        if k_cache is None or v_cache is None or write is None:
            keys, values, key_pos = k, v, positions
        else:
            # write this chunk at each row's positions; rows not written aim past the end
            # of the cache, and those writes are dropped (no copy of the cache)
            rows = jnp.arange(b)[:, None, None]
            heads = jnp.arange(cfg.num_heads)[None, :, None]
            at = jnp.where(write[:, None], positions, cfg.max_len)[:, None, :]
            k_cache = k_cache.at[rows, heads, at].set(k, mode="drop")
            v_cache = v_cache.at[rows, heads, at].set(v, mode="drop")
            keys, values = k_cache, v_cache
            key_pos = jnp.broadcast_to(jnp.arange(cfg.max_len), (b, cfg.max_len))
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, keys) / jnp.sqrt(cfg.head_dim)
        causal = key_pos[:, None, None, :] <= positions[:, None, :, None]
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        attn = jax.nn.softmax(scores, axis=-1)
        y = jnp.einsum("bhqk,bhkd->bqhd", attn, values).reshape(b, t, cfg.d_model)
        x = x + self.out(y)
        x = x + self.down(jax.nn.gelu(self.up(self.norm2(x))))
        return x, k_cache, v_cache


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotary position embedding of ``x [B, T, H, D]`` at ``positions [B, T]``."""
    d = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(d) / d))
    angle = positions[..., None].astype(jnp.float32) * freq
    cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
    x1, x2 = x[..., :d], x[..., d:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class Transformer(nnx.Module):
    """``model(tokens, positions, cache=None, write=None) -> (logits, cache)``.

    Without a cache: a causal pass over ``tokens [B, T]``. With a cache: the tokens are
    written into the cache at ``positions`` for the rows where ``write [B]`` is true and
    attend to everything in the row's cache at or before their position.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache | None = None,
        write: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        x = self.embed(tokens)
        ks: list[jax.Array] = []
        vs: list[jax.Array] = []
        for i, block in enumerate(self.blocks):
            kc = None if cache is None else cache.k[i]
            vc = None if cache is None else cache.v[i]
            x, kc, vc = block(x, positions, kc, vc, write)
            if kc is not None and vc is not None:
                ks.append(kc)
                vs.append(vc)
        logits = self.embed.attend(self.norm(x))
        if cache is None:
            return logits, None
        return logits, KVCache(tuple(ks), tuple(vs))


def init_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    return Transformer(cfg, nnx.Rngs(seed))


def token_logprobs(model: Transformer, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
    """``logprobs[b, t]``: log-probability of ``tokens[b, t]`` given the tokens before it,
    under the temperature-scaled policy (0 at t = 0)."""
    return token_logprobs_and_entropy(model, tokens, temperature)[0]


def token_logprobs_and_entropy(
    model: Transformer, tokens: jax.Array, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """``token_logprobs`` and the entropy of each next-token distribution, from one full
    causal pass, in float32 (0 at t = 0): what the trainer differentiates is what the
    sampler recorded."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, _ = model(tokens, positions)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    pad = jnp.zeros((b, 1), jnp.float32)
    return jnp.concatenate([pad, picked], 1), jnp.concatenate([pad, entropy], 1)


def finite_leaves(tree: Any) -> jax.Array:
    """Whether every leaf of ``tree`` is finite, as a traced boolean (usable under jit)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def all_finite(tree: Any) -> bool:
    """Whether every floating-point leaf of ``tree`` is finite (on the host)."""
    return bool(
        finite_leaves(
            [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
        )
    )
