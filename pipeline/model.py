"""The policy: a decoder-only transformer in Flax NNX with a key-value cache.

One forward function serves training (a full causal pass over ``[B, T]``) and sampling
(chunks of new tokens appended to a per-row cache at each row's own position), so the
log-probabilities a producer records are computed by exactly the code the trainer
differentiates.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pipeline.errors import InvalidConfigError


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the policy. The default trains on two CPU cores in minutes."""

    vocab_size: int = 272
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    d_ff: int = 512
    max_len: int = 256

    def __post_init__(self) -> None:
        sizes = dataclasses.astuple(self)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
            raise InvalidConfigError(f"model sizes must be integers: {str(self)[:300]}")
        if min(sizes) < 1 or max(sizes) > 2**24:
            raise InvalidConfigError(f"model sizes must lie in [1, 2**24]: {str(self)[:300]}")
        if self.d_model % self.num_heads:
            raise InvalidConfigError(
                f"d_model {self.d_model} is not a multiple of num_heads {self.num_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        """The configuration in ``text``; InvalidConfigError for anything else."""
        try:
            fields = json.loads(text)
            return cls(**fields)
        except InvalidConfigError:
            raise
        except (ValueError, TypeError, RecursionError) as e:
            raise InvalidConfigError(f"not a model configuration: {str(e)[:200]}") from None


#: Configurations by name: ``tiny`` for CPUs and tests, larger ones for accelerators.
PRESETS = {
    "tiny": ModelConfig(),
    "small": ModelConfig(d_model=256, num_layers=4, num_heads=8, d_ff=1024, max_len=512),
    "base": ModelConfig(d_model=768, num_layers=12, num_heads=12, d_ff=3072, max_len=2048),
}


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
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, _ = model(tokens, positions)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.concatenate([jnp.zeros((b, 1), picked.dtype), picked], axis=1)
