"""The policy: a decoder-only transformer in Flax NNX with a key-value cache.

One forward function serves training (a full causal pass over ``[B, T]``) and sampling
(chunks of new tokens appended to a per-row cache at each row's own position), so the
log-probabilities a producer records are computed by exactly the code the trainer
differentiates.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipeline.policy import native_attention
from pipeline.policy.config import ModelConfig


class KVCache(NamedTuple):
    """Keys and values, one array per layer, each ``[batch, kv_heads, max_len, head_dim]``."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int) -> KVCache:
        shape = (batch, cfg.kv_heads, cfg.max_len, cfg.head_dim)
        dtype = jnp.dtype(cfg.dtype)
        layers = range(cfg.num_layers)
        return cls(
            tuple(jnp.zeros(shape, dtype) for _ in layers),
            tuple(jnp.zeros(shape, dtype) for _ in layers),
        )


class RMSNorm(nnx.Module):
    """``scale * x / rms(x)``, the mean square taken in float32 (as Hugging Face does)."""

    def __init__(self, dim: int, eps: float, dtype: Any) -> None:
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * normed.astype(x.dtype)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        d, hd, dt = cfg.d_model, cfg.head_dim, jnp.dtype(cfg.dtype)

        def linear(i: int, o: int, bias: bool = False) -> nnx.Linear:
            return nnx.Linear(i, o, use_bias=bias, dtype=dt, param_dtype=dt, rngs=rngs)

        self.norm1 = RMSNorm(d, cfg.norm_eps, dt)
        self.q = linear(d, cfg.num_heads * hd, cfg.qkv_bias)
        self.k = linear(d, cfg.kv_heads * hd, cfg.qkv_bias)
        self.v = linear(d, cfg.kv_heads * hd, cfg.qkv_bias)
        self.out = linear(cfg.num_heads * hd, d)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps, dt)
            self.k_norm = RMSNorm(hd, cfg.norm_eps, dt)
        self.norm2 = RMSNorm(d, cfg.norm_eps, dt)
        if cfg.gated:
            self.gate = linear(d, cfg.d_ff)
        self.up = linear(d, cfg.d_ff)
        self.down = linear(cfg.d_ff, d)
        # a constant of the compiled program, not a parameter
        self.inv_freq = tuple(float(f) for f in rope_frequencies(cfg))

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        k_cache: jax.Array | None,
        v_cache: jax.Array | None,
        write: jax.Array | None,
        segments: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        cfg = self.cfg
        b, t, _ = x.shape
        kvh, hd = cfg.kv_heads, cfg.head_dim
        h = self.norm1(x)
        q = self.q(h).reshape(b, t, cfg.num_heads, hd)
        k = self.k(h).reshape(b, t, kvh, hd)
        v = self.v(h).reshape(b, t, kvh, hd)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        q, k = rope(q, positions, inv_freq), rope(k, positions, inv_freq)
        # heads before positions ([B, H, T, D]): attention needs no transpose of the cache
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        if k_cache is None or v_cache is None or write is None:
            keys, values, key_pos, cached = k, v, positions, False
        else:
            # write this chunk at each row's positions; rows not written aim past the end
            # of the cache, and those writes are dropped (no copy of the cache)
            rows = jnp.arange(b)[:, None, None]
            heads = jnp.arange(kvh)[None, :, None]
            at = jnp.where(write[:, None], positions, cfg.max_len)[:, None, :]
            k_cache = k_cache.at[rows, heads, at].set(k, mode="drop")
            v_cache = v_cache.at[rows, heads, at].set(v, mode="drop")
            keys, values = k_cache, v_cache
            key_pos = jnp.broadcast_to(jnp.arange(cfg.max_len), (b, cfg.max_len))
            cached = True
        # grouped-query attention: query head h reads key-value head h // group
        group = cfg.num_heads // kvh
        q = q.reshape(b, kvh, group, t, hd)
        if cached and native_attention.usable(q, keys):
            # a decode step (one token per row) on CPU: the native kernel, same result
            y = native_attention.decode_attention(q, keys, values, positions[:, 0])
            return self._feed_forward(x, y.reshape(b, t, cfg.num_heads * hd), k_cache, v_cache)
        scores = jnp.einsum("bkgqd,bksd->bkgqs", q, keys).astype(jnp.float32) * hd**-0.5
        causal = key_pos[:, None, None, None, :] <= positions[:, None, None, :, None]
        if segments is not None:  # packed rows: each token attends within its own segment
            causal &= segments[:, None, None, None, :] == segments[:, None, None, :, None]
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        attn = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
        y = jnp.einsum("bkgqs,bksd->bqkgd", attn, values).reshape(b, t, cfg.num_heads * hd)
        return self._feed_forward(x, y, k_cache, v_cache)

    def _feed_forward(
        self, x: jax.Array, y: jax.Array, k_cache: jax.Array | None, v_cache: jax.Array | None
    ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        x = x + self.out(y)
        h = self.norm2(x)
        if self.cfg.gated:
            h = jax.nn.silu(self.gate(h)) * self.up(h)
        else:
            h = jax.nn.gelu(self.up(h))
        return x + self.down(h), k_cache, v_cache


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies of the rotary embedding, ``[head_dim / 2]`` float32, with the
    llama3 scaling when configured (as Hugging Face computes them)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    if cfg.rope_scaling == "llama3":
        factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old = cfg.rope_original_max_len
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return np.asarray(inv, np.float32)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary position embedding of ``x [B, T, H, D]`` at ``positions [B, T]`` (the halves
    of each head rotated together, as in Llama and Qwen)."""
    d = x.shape[-1] // 2
    angle = positions[..., None].astype(jnp.float32) * inv_freq
    cos = jnp.cos(angle)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(angle)[:, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :d], x[..., d:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class Transformer(nnx.Module):
    """``model(tokens, positions, cache=None, write=None, segments=None) -> (logits, cache)``.

    Without a cache: a causal pass over ``tokens [B, T]``; with ``segments [B, T]`` a row
    holds several sequences (packed), each token attending only to earlier tokens of its
    own segment, and ``positions`` restart in each. With a cache: the tokens are
    written into the cache at ``positions`` for the rows where ``write [B]`` is true and
    attend to everything in the row's cache at or before their position. The same code
    is the built-in policy and the Llama and Qwen families (:class:`ModelConfig`).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        dt = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=dt, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, dt)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Linear(
                cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs
            )

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[jax.Array, KVCache | None]:
        """Logits over the vocabulary (the arguments of :meth:`features`)."""
        x, cache = self.features(*args, **kwargs)
        return self.logits(x), cache

    def logits(self, x: jax.Array) -> jax.Array:
        """The output layer on hidden states from :meth:`features`. Ids past the
        tokenizer's vocabulary (``output_vocab``: padded rows of a Hugging Face output
        layer) get a logit of -1e9, so that neither the sampler nor the trainer's
        log-probabilities give them any mass (finite, so entropies stay finite)."""
        out = self.embed.attend(x) if self.cfg.tie_embeddings else self.lm_head(x)
        valid = self.cfg.output_vocab
        if 0 < valid < self.cfg.vocab_size:
            keep = jnp.arange(self.cfg.vocab_size) < valid
            out = jnp.where(keep, out, jnp.asarray(-1e9, out.dtype))
        return out

    def features(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache | None = None,
        write: jax.Array | None = None,
        segments: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """The final normalised hidden states ``[B, T, d_model]`` the logits are read
        from (and a critic's value head, :mod:`pipeline.train.grpo`)."""
        x = self.embed(tokens)
        ks: list[jax.Array] = []
        vs: list[jax.Array] = []
        for i, block in enumerate(self.blocks):
            kc = None if cache is None else cache.k[i]
            vc = None if cache is None else cache.v[i]
            x, kc, vc = block(x, positions, kc, vc, write, segments)
            if kc is not None and vc is not None:
                ks.append(kc)
                vs.append(vc)
        x = self.norm(x)
        if cache is None:
            return x, None
        return x, KVCache(tuple(ks), tuple(vs))


def init_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    return Transformer(cfg, nnx.Rngs(seed))


def token_logprobs(model: Transformer, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
    """``logprobs[b, t]``: log-probability of ``tokens[b, t]`` given the tokens before it,
    under the temperature-scaled policy (0 at t = 0)."""
    return token_logprobs_and_entropy(model, tokens, temperature)[0]


def token_logprobs_and_entropy(
    model: Transformer,
    tokens: jax.Array,
    temperature: float = 1.0,
    positions: jax.Array | None = None,
    segments: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``token_logprobs`` and the entropy of each next-token distribution, from one full
    causal pass, in float32 (0 at t = 0): what the trainer differentiates is what the
    sampler recorded. Packed rows pass their ``positions`` and ``segments``; the value at
    a segment's first token is then computed from another segment and means nothing."""
    return token_logprobs_entropy_features(model, tokens, temperature, positions, segments)[:2]


def token_logprobs_entropy_features(
    model: Transformer,
    tokens: jax.Array,
    temperature: float = 1.0,
    positions: jax.Array | None = None,
    segments: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`token_logprobs_and_entropy` and, aligned with them, the hidden state each
    token was predicted from (``[B, T, d_model]``, zeros at t = 0)."""
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    x, _ = model.features(tokens, positions, segments=segments)
    logits = model.logits(x)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    pad = jnp.zeros((b, 1), jnp.float32)
    before = jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], 1)
    return jnp.concatenate([pad, picked], 1), jnp.concatenate([pad, entropy], 1), before


def finite_leaves(tree: Any) -> jax.Array:
    """Whether every leaf of ``tree`` is finite, as a traced boolean (usable under jit)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


#: one compiled computation for the whole tree: in a trainer group each leaf's check is
#: a collective, and dozens of op-by-op collectives in flight at once over arrays sharded
#: across processes deadlock both members (seen on CPU with gloo)
_finite_leaves = jax.jit(finite_leaves)


def all_finite(tree: Any) -> bool:
    """Whether every floating-point leaf of ``tree`` is finite (on the host)."""
    leaves = [
        x
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype if hasattr(x, "dtype") else np.result_type(x), jnp.floating)
    ]
    return bool(_finite_leaves(leaves))
