"""LoRA: only the adapters train, their update is the chain rule through the merged
kernel, and adapter checkpoints restore onto the base they name."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from pipeline.errors import InvalidConfigError
from pipeline.policy.checkpoint import VERSION_FILE, digest, save_params
from pipeline.policy.config import LoRAConfig, ModelConfig
from pipeline.policy.lora import (
    adapter_meta,
    init_adapters,
    layers,
    merged,
    restore_weights,
    save_adapters,
)
from pipeline.policy.model import init_model, token_logprobs
from pipeline.train.config import GRPOConfig, TrainerConfig
from pipeline.train.grpo import init_state, make_train_step
from tests.unit.test_algorithms import _batch

CFG = ModelConfig(d_model=32, num_layers=2, num_heads=2, d_ff=64, max_len=64)
LORA = LoRAConfig(rank=4, alpha=8.0, targets=("q", "v", "up", "down"))


def _kernel(params: nnx.State, name: str) -> np.ndarray:
    _, block, layer = name.split(".")
    return np.asarray(params["blocks"][int(block)][layer]["kernel"][...], np.float64)


def _nonzero(adapters: dict, seed: int = 1) -> dict:
    """Adapters whose B is not zero (fresh ones have zero B, and so no gradient on A)."""
    rng = np.random.default_rng(seed)
    return {
        k: {"a": v["a"], "b": (rng.standard_normal(v["b"].shape) * 0.05).astype(np.float32)}
        for k, v in adapters.items()
    }


def test_fresh_adapters_leave_the_policy_as_the_base() -> None:
    model = init_model(CFG, seed=3)
    _, params = nnx.split(model)
    adapters = init_adapters(CFG, LORA, seed=0)
    assert sorted(adapters) == sorted(layers(CFG, LORA))
    assert len(adapters) == 2 * 4
    assert adapters["blocks.0.up"]["a"].shape == (32, 4)
    assert adapters["blocks.0.down"]["b"].shape == (4, 32)
    same = merged(params, adapters, LORA.scale)
    for name in adapters:
        np.testing.assert_array_equal(_kernel(same, name), _kernel(params, name))
    moved = merged(params, _nonzero(adapters), LORA.scale)
    a, b = (np.asarray(x, np.float64) for x in _nonzero(adapters)["blocks.1.q"].values())
    np.testing.assert_allclose(
        _kernel(moved, "blocks.1.q"), _kernel(params, "blocks.1.q") + 2.0 * a @ b, atol=1e-6
    )
    np.testing.assert_array_equal(  # the base itself is left as it was
        _kernel(params, "blocks.1.q"), np.asarray(nnx.state(model)["blocks"][1]["q"]["kernel"][...])
    )


def test_a_lora_step_moves_the_adapters_by_the_chain_rule_and_never_the_base() -> None:
    """With plain SGD the adapters' step is ``-lr * grad``; by the chain rule through
    ``W + s A B`` the gradients are ``s * dW @ B^T`` and ``s * A^T @ dW``, where ``dW``
    is the gradient of the same loss with respect to the merged kernel (a full-parameter
    step from the merged parameters, computed here with the same loss)."""
    lr = 0.5
    cfg = GRPOConfig(correction="tis")
    model = init_model(CFG, seed=3)
    batch = _batch(model, rows=4, length=16)
    tx = optax.sgd(lr)
    graphdef, state = init_state(model, tx, reference=False, lora=LORA, seed=0)
    adapters = _nonzero(state.adapters)
    state = state._replace(adapters=adapters, opt_state=tx.init(adapters))
    assert state.reference is None  # the base is the reference
    base_before = jax.tree.map(np.asarray, state.params)
    step = make_train_step(graphdef, cfg, tx, lora=LORA)
    after, metrics = step(state, batch)
    assert float(metrics["applied"]) == 1.0
    jax.tree.map(np.testing.assert_array_equal, base_before, jax.tree.map(np.asarray, after.params))

    full_model = nnx.merge(graphdef, merged(state.params, adapters, LORA.scale))
    _, full = init_state(full_model, tx, reference=False)
    full_after, full_metrics = make_train_step(graphdef, cfg, tx)(full, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(full_metrics["loss"]), rtol=1e-5)
    s = LORA.scale
    for name, ab in adapters.items():
        a, b = np.asarray(ab["a"], np.float64), np.asarray(ab["b"], np.float64)
        dw = (_kernel(full.params, name) - _kernel(full_after.params, name)) / lr
        da = (a - np.asarray(after.adapters[name]["a"], np.float64)) / lr
        db = (b - np.asarray(after.adapters[name]["b"], np.float64)) / lr
        np.testing.assert_allclose(da, s * dw @ b.T, atol=2e-5)
        np.testing.assert_allclose(db, s * a.T @ dw, atol=2e-5)
    assert (
        max(np.abs(np.asarray(v["b"]) - adapters[k]["b"]).max() for k, v in after.adapters.items())
        > 1e-4
    )


def test_the_optimizer_holds_state_for_the_adapters_alone() -> None:
    model = init_model(CFG, seed=0)
    tx = GRPOConfig().optimizer()
    _, full = init_state(model, tx, reference=False)
    _, lora = init_state(model, tx, reference=True, lora=LORA)

    def size(tree: object) -> int:
        return sum(np.size(x) for x in jax.tree.leaves(tree))

    adapters = size(lora.adapters)
    assert adapters == 2 * 2 * 4 * (32 + 32) + 2 * (4 * (32 + 64) + 4 * (64 + 32))
    assert size(lora.opt_state) <= 2 * adapters + 8  # AdamW's two moments and counters
    assert size(full.opt_state) >= 2 * size(full.params)
    assert lora.reference is None  # a KL term reads the base


def test_adapters_round_trip_onto_the_base_they_name(tmp_path: Path) -> None:
    model = init_model(CFG, seed=5)
    base = save_params(tmp_path / "base", model, 0)
    adapters = _nonzero(init_adapters(CFG, LORA, seed=2))
    path = save_adapters(tmp_path / "v3", adapters, 3, CFG, LORA, base, digest(base))
    lora, uri, base_digest = adapter_meta(path)  # type: ignore[misc]
    assert (lora, uri, base_digest) == (LORA, str(base.absolute()), digest(base))
    assert adapter_meta(base) is None
    restored = restore_weights(path, CFG)
    expected = merged(nnx.state(model, nnx.Param), adapters, LORA.scale)
    jax.tree.map(np.testing.assert_allclose, expected, restored)
    tokens = np.arange(12, dtype=np.int32)[None] + 7
    np.testing.assert_allclose(
        token_logprobs(nnx.merge(nnx.graphdef(model), restored), tokens),
        token_logprobs(nnx.merge(nnx.graphdef(model), expected), tokens),
        atol=1e-6,
    )
    # a description that is not one is refused with a reason
    (path / VERSION_FILE).write_text(json.dumps({"policy_version": 3, "lora": {"rank": -1}}))
    with pytest.raises(ValueError, match="does not describe an adapter checkpoint"):
        adapter_meta(path)
    # adapters of another rank do not restore into this one
    other = save_adapters(
        tmp_path / "v4",
        init_adapters(CFG, LoRAConfig(rank=2), 0),
        4,
        CFG,
        LoRAConfig(rank=2),
        base,
        digest(base),
    )
    meta = json.loads((other / VERSION_FILE).read_text())
    meta["lora"]["rank"] = 4
    (other / VERSION_FILE).write_text(json.dumps(meta))
    with pytest.raises(Exception):  # noqa: B017 - orbax's own shape error
        restore_weights(other, CFG)


@pytest.mark.parametrize(
    "fields",
    [
        {"rank": -1},
        {"rank": 4, "alpha": 0.0},
        {"rank": 4, "targets": ("q", "attn")},
        {"rank": 4, "targets": ()},
        {"rank": 4, "targets": ("q", "q")},
    ],
)
def test_bad_lora_settings_are_refused(fields: dict) -> None:
    with pytest.raises(InvalidConfigError, match="lora"):
        LoRAConfig(**fields)


def test_a_target_the_model_lacks_is_refused_in_one_sentence() -> None:
    with pytest.raises(InvalidConfigError, match="gate exists only"):
        layers(ModelConfig(), LoRAConfig(rank=2, targets=("gate",)))
    gated = ModelConfig(family="llama", d_model=32, num_heads=2, d_ff=64, num_layers=1)
    assert list(layers(gated, LoRAConfig(rank=2, targets=("gate",)))) == ["blocks.0.gate"]
    assert TrainerConfig(lora=LoRAConfig(rank=8)).lora.scale == 2.0


def test_a_trainer_restarted_with_other_lora_settings_is_refused_in_one_sentence(
    tmp_path: Path,
) -> None:
    import dataclasses

    from pipeline.train.trainer import Trainer

    class Source:  # a recording with nothing in it
        def subscribe(self, topics: object, on_assign: object, on_revoke: object) -> None:
            pass

    cfg = TrainerConfig(namespace="ns", run_dir=tmp_path, buckets=(64,), model=CFG)
    trainer = Trainer(cfg, None, source=Source())
    trainer._checkpoint(announce=False)
    trainer.ckpt.close()
    with pytest.raises(InvalidConfigError, match="another structure than this trainer's"):
        Trainer(dataclasses.replace(cfg, lora=LoRAConfig(rank=2)), None, source=Source())
