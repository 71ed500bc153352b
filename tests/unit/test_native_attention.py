"""The native decode-attention kernel computes what the einsum path computes."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.policy import native_attention
from pipeline.policy.config import ModelConfig, SamplingConfig
from pipeline.policy.model import init_model
from pipeline.policy.sampler import DecodeEngine


def reference(q: jax.Array, keys: jax.Array, values: jax.Array, positions: jax.Array) -> jax.Array:
    """The model's einsum path for one token per row."""
    slots, dim = keys.shape[2], keys.shape[3]
    scores = jnp.einsum("bkgqd,bksd->bkgqs", q, keys) * dim**-0.5
    causal = jnp.arange(slots)[None, None, None, None, :] <= positions[:, None, None, None, None]
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bkgqs,bksd->bqkgd", jax.nn.softmax(scores, -1), values)


def test_the_kernel_is_built_on_this_machine() -> None:
    # CI has a C++ compiler: a kernel silently not built would leave the rest of this file
    # comparing the einsum path with itself
    assert native_attention.available()


@pytest.mark.parametrize(("rows", "kv_heads", "group", "slots", "dim"), [
    (5, 2, 7, 40, 64),  # the 0.5B shape's heads
    (3, 1, 1, 17, 12),  # one head, an odd width
    (9, 4, 2, 33, 8),  # more rows than work chunks
])  # fmt: skip
def test_the_kernel_matches_the_einsum_path(
    rows: int, kv_heads: int, group: int, slots: int, dim: int
) -> None:
    rng = np.random.default_rng(rows)
    q = jnp.asarray(rng.normal(size=(rows, kv_heads, group, 1, dim)) * 3, jnp.float32)
    keys = jnp.asarray(rng.normal(size=(rows, kv_heads, slots, dim)), jnp.float32)
    values = jnp.asarray(rng.normal(size=(rows, kv_heads, slots, dim)), jnp.float32)
    # the first slot, the last, one in between, and past the end (clamped to the last)
    positions = jnp.asarray([[0, slots - 1, slots // 2, slots + 5][i % 4] for i in range(rows)])
    got = jax.jit(native_attention.decode_attention)(q, keys, values, positions)
    want = reference(q, keys, values, positions)
    assert got.shape == want.shape == (rows, 1, kv_heads, group, dim)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def test_a_row_with_no_key_gives_zeros_not_nan() -> None:
    q = jnp.full((2, 1, 2, 1, 4), 1e30, jnp.float32)
    cache = jnp.ones((2, 1, 6, 4), jnp.float32)
    got = np.asarray(native_attention.decode_attention(q, cache, cache, jnp.asarray([-1, 3])))
    assert not np.isnan(got).any()
    assert (got[0] == 0).all()
    assert np.allclose(got[1], 1.0)  # equal scores of huge size: the mean of the values


def test_greedy_decoding_is_the_same_with_and_without_the_kernel(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cfg = ModelConfig(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=96, max_len=48)
    model = init_model(cfg, seed=3)

    def decode() -> tuple[list[list[int]], list[list[float]]]:
        engine = DecodeEngine(model, slots=3, sampling=SamplingConfig(0.0), chunk=4)
        prompts = {0: [257, 5, 9], 1: list(range(1, 15)), 2: [257]}
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        for s, p in prompts.items():
            engine.append(s, p)
        for _ in range(12):
            for s, (tok, lp, _) in engine.step(list(prompts)).items():
                tokens[s].append(tok)
                logprobs[s].append(lp)
        return tokens, logprobs

    assert native_attention.available()
    with_kernel = decode()
    monkeypatch.setenv("RLSTREAM_NATIVE_ATTENTION", "0")
    without = decode()
    assert with_kernel[0] == without[0]
    np.testing.assert_allclose(with_kernel[1], without[1], atol=1e-5)


def test_no_compiler_falls_back_to_the_einsum_path_with_one_warning(  # type: ignore[no-untyped-def]
    monkeypatch, tmp_path, caplog
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native_attention, "_state", {})
    with caplog.at_level(logging.WARNING, logger=native_attention.__name__):
        assert not native_attention.available()
        assert not native_attention.available()  # decided once
    warnings = [r for r in caplog.records if "einsum path instead" in r.getMessage()]
    assert len(warnings) == 1
    assert not list(tmp_path.rglob("*.so"))
