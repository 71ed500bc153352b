"""Logprob parity: the train step compares the sampler's log-probabilities with its own on
the tokens its version sampled, and names the trajectories where they part."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.errors import InvalidConfigError
from pipeline.policy.config import ModelConfig, SamplingConfig
from pipeline.policy.hf_config import read_model_config
from pipeline.policy.hf_init import init_checkpoint
from pipeline.policy.hf_weights import load_model
from pipeline.policy.sampler import DecodeEngine
from pipeline.records.trajectory import Trajectory
from pipeline.testing import make_trajectory
from pipeline.train.batching import Group, Member, assemble, pack
from pipeline.train.config import GRPOConfig, TrainerConfig
from pipeline.train.grpo import init_state, make_train_step
from pipeline.train.parity import check, summarize

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint(tmp_path_factory.mktemp("hf") / "qwen3", "qwen3", "tiny", seed=0)


def _sampled(model: object, n: int, seed: int, version: int) -> Trajectory:
    """A trajectory of ``n`` tokens whose assistant turns the KV-cached sampler wrote
    (token by token, observations appended between turns), with its log-probabilities."""
    t = make_trajectory(n, rng=np.random.default_rng(seed), turns=4, versions=(version,))
    engine = DecodeEngine(model, slots=1, sampling=SamplingConfig(TEMPERATURE, 1.0, seed=seed))
    engine.reset(0)
    tokens = t.tokens.copy()
    logprobs = np.zeros(n, np.float32)
    i = 0
    while i < n:
        if t.loss_mask[i]:
            tok, lp, _ = engine.step([0])[0]
            tokens[i], logprobs[i] = tok, lp
            i += 1
        else:  # an observation: the environment's tokens, fed without sampling
            j = i
            while j < n and not t.loss_mask[j]:
                j += 1
            engine.append(0, [int(x) for x in tokens[i:j]])
            i = j
    return dataclasses.replace(t, tokens=tokens, logprobs=logprobs)


def _group(trajectories: list[Trajectory]) -> Group:
    g = Group("g", "synthetic", len(trajectories), 0.0)
    for k, t in enumerate(trajectories):
        g.members[k] = Member(
            dataclasses.replace(t, group_index=k, group_size=len(trajectories)), None
        )  # type: ignore[arg-type]
    return g


def _step_log_ratio(model: object, batch: object, grpo: GRPOConfig) -> np.ndarray:
    tx = grpo.optimizer()
    graphdef, state = init_state(model, tx, reference=False)  # type: ignore[arg-type]
    _, metrics = make_train_step(graphdef, grpo, tx)(state, batch)
    return np.asarray(metrics["sampler_log_ratio"])


def test_a_qwen_checkpoint_samples_what_it_trains_in_float32(qwen3: Path) -> None:
    """Float32: trainer and sampler agree within 1e-4 (p99) on every sampled token, in
    a packed batch split into minibatches and micro-batches (rows come back in order)."""
    model = load_model(read_model_config(qwen3))
    trajectories = [_sampled(model, n, seed, version=3) for seed, n in enumerate([40, 56, 24, 48])]
    grpo = GRPOConfig(temperature=TEMPERATURE, minibatches=2, microbatches=2)
    batch, members = pack([_group(trajectories)], 4, 64, grpo, version=3)
    log_ratio = _step_log_ratio(model, batch, grpo)
    figures, flagged = summarize(log_ratio, members, 0, 1e-3)
    policy_tokens = sum(int(t.loss_mask[1:].sum()) for t in trajectories)
    assert figures["parity_tokens"] == policy_tokens
    assert figures["logprob_diff_p99"] <= 1e-4, figures
    assert 0 <= figures["mismatch_kl"] < 1e-8 and not flagged
    # tokens another version sampled are not compared: they are off-policy by design
    batch, members = pack([_group(trajectories)], 4, 64, grpo, version=4)
    figures, _ = summarize(_step_log_ratio(model, batch, grpo), members, 0, 1e-3)
    assert figures == {"parity_tokens": 0.0}


def test_a_sampler_that_disagrees_is_named(qwen3: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One trajectory's log-probabilities off by 0.7 on one token (a wrong position, a
    template re-tokenised differently): the figures show it and its id is the one named."""
    model = load_model(read_model_config(qwen3))
    good = [_sampled(model, 32, seed, version=0) for seed in range(3)]
    bad = good[1]
    lp = bad.logprobs.copy()
    k = int(np.flatnonzero(bad.loss_mask)[2])
    lp[k] -= 0.7
    good[1] = dataclasses.replace(bad, logprobs=lp)
    grpo = GRPOConfig(temperature=TEMPERATURE)
    batch, members = assemble([_group(good)], 4, (32,), grpo, version=0)
    log_ratio = _step_log_ratio(model, batch, grpo)
    figures, flagged = summarize(log_ratio, members, 0, 0.1)
    assert flagged == [bad.trajectory_id]
    assert abs(figures["logprob_diff_max"] - 0.7) < 1e-3
    assert figures["mismatch_kl"] > 0
    # a trainer group: this member's rows start further down the global batch
    wide = np.full((8, log_ratio.shape[1]), np.nan, np.float32)
    wide[4:] = log_ratio
    assert summarize(wide, members, 4, 0.1)[1] == [bad.trajectory_id]
    # the trainer's check logs the step and the ids
    with caplog.at_level(logging.WARNING, logger="pipeline.train.parity"):
        assert check(log_ratio, members, 0, 0.1, 7) == figures
    assert "step 7 has 1 trajectories" in caplog.text and bad.trajectory_id in caplog.text


def test_bfloat16_parity_is_stated(qwen3: Path) -> None:
    """bfloat16 weights and activations on both sides (the model's one ``dtype``): the
    same code computes both, so the gap stays at float32's level on CPU (measured p99
    1.2e-7, README.md), well below 1e-3 and the default threshold."""
    cfg = read_model_config(qwen3)
    model = load_model(ModelConfig.from_json(cfg.to_json().replace("float32", "bfloat16")))
    assert model.embed.embedding[...].dtype == jnp.bfloat16
    trajectories = [_sampled(model, 48, seed, version=0) for seed in range(4)]
    grpo = GRPOConfig(temperature=TEMPERATURE)
    batch, members = pack([_group(trajectories)], 4, 64, grpo, version=0)
    figures, flagged = summarize(_step_log_ratio(model, batch, grpo), members, 0, 0.5)
    assert figures["parity_tokens"] > 0
    assert figures["logprob_diff_p99"] < 1e-3 and not flagged


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), float("inf")])
def test_the_threshold_must_be_a_positive_number(bad: float) -> None:
    with pytest.raises(InvalidConfigError, match="parity_threshold"):
        TrainerConfig(parity_threshold=bad)
