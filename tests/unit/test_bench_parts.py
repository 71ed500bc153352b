"""Pieces of the benchmarks whose figures the documentation quotes."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from pipeline.bench.model import train_flops_per_token
from pipeline.policy.config import ModelConfig
from pipeline.policy.model import init_model


@pytest.mark.parametrize("tied", [True, False])
def test_model_flops_leave_out_the_embedding_lookup_and_count_attention(tied: bool) -> None:
    cfg = ModelConfig(
        d_model=32, num_layers=2, num_heads=4, d_ff=64, max_len=64, tie_embeddings=tied
    )
    leaves = jax.tree.leaves(nnx.state(init_model(cfg, 0), nnx.Param))
    total = sum(x.size for x in leaves)
    # the input table is a lookup; tied, the same table is the output head's product
    lookup = 0 if tied else cfg.vocab_size * cfg.d_model
    t = 48
    attention = 12 * 2 * 4 * (32 // 4) * t  # 12 * layers * heads * head dim * length
    assert train_flops_per_token(cfg, t) == 6 * (total - lookup) + attention
