"""The loss variants a researcher chooses between, each against numpy computed here."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.kafka.transport import Coordinates
from pipeline.policy.config import ModelConfig
from pipeline.policy.model import init_model, token_logprobs
from pipeline.testing import make_trajectory
from pipeline.train.advantages import advantages, overlong_penalty, zero_variance
from pipeline.train.batching import GroupBuffer, assemble, pack, row_choices, rows_to_pack
from pipeline.train.config import GRPOConfig
from pipeline.train.grpo import TrainState, init_state, make_train_step
from pipeline.train.objective import Batch

CFG = ModelConfig(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=64)


def test_advantage_estimators() -> None:
    r = np.array([1.0, 0.0, 0.0, 3.0])
    mean, std = 1.0, np.sqrt(((r - 1.0) ** 2).mean())  # population std: sqrt(1.5)
    np.testing.assert_allclose(advantages(r, "grpo", 0.0), (r - mean) / std)
    np.testing.assert_allclose(advantages(r, "drgrpo"), [0.0, -1.0, -1.0, 2.0])
    # leave-one-out: r_i minus the mean of the other three
    np.testing.assert_allclose(advantages(r, "rloo"), [1 - 1, 0 - 4 / 3, 0 - 4 / 3, 3 - 1 / 3])
    assert advantages(np.array([5.0]), "rloo").tolist() == [0.0]
    assert zero_variance(np.array([1.0, 1.0])) and not zero_variance(r)


def test_overlong_shaping() -> None:
    # no penalty up to 80 tokens, linear to -1 at 100, -1 past it
    assert overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert overlong_penalty(90, 100, 20, 1.0) == pytest.approx(-0.5)
    assert overlong_penalty(100, 100, 20, 1.0) == -1.0
    assert overlong_penalty(500, 100, 20, 2.0) == -2.0
    assert overlong_penalty(10**6, 0, 0, 1.0) == 0.0  # off


def _batch(model: Any, rows: int = 4, length: int = 16, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (rows, length)).astype(np.int32)
    mask = np.zeros((rows, length), np.float32)
    for i in range(rows):  # rows with different numbers of policy tokens
        mask[i, length // 2 - i :] = 1
    logp = np.asarray(token_logprobs(model, jnp.asarray(tokens)))
    behaviour = (logp + rng.normal(0, 0.4, logp.shape)).astype(np.float32) * mask
    adv = rng.standard_normal(rows).astype(np.float32)
    return Batch(tokens, mask, behaviour, adv, np.ones(rows, np.float32))


def _reference_loss(
    logp: np.ndarray, b: Batch, cfg: GRPOConfig, ref: np.ndarray | None = None
) -> float:
    """The truncated-IS objective, by hand, in float64."""
    logp, mu, m = logp.astype(float), b.behaviour.astype(float), b.mask.astype(float)
    lr = logp - mu
    if cfg.ratio == "sequence":
        lr = np.repeat(((lr * m).sum(1) / m.sum(1))[:, None], lr.shape[1], 1)
    r = np.exp(lr)
    a = b.advantage.astype(float)[:, None]
    per = -np.minimum(
        np.minimum(r, cfg.is_cap) * a, np.clip(r, 1 - cfg.clip_low, 1 + cfg.clip_high) * a
    )
    if ref is not None:
        d = ref.astype(float) - logp
        per += cfg.kl_coef * (-d if cfg.kl_estimator == "k1" else np.exp(d) - d - 1)
    if cfg.aggregation == "token_mean":
        return float((per * m).sum() / m.sum())
    rows = (per * m).sum(1)
    if cfg.aggregation == "seq_mean_token_mean":
        rows = rows / m.sum(1)
    return float(rows.mean())


@pytest.mark.parametrize(
    "variant",
    [
        {"aggregation": "token_mean"},
        {"aggregation": "seq_mean_token_mean"},
        {"aggregation": "seq_mean_token_sum"},
        {"clip_low": 0.2, "clip_high": 0.2},  # symmetric PPO clip
        {"clip_low": 0.2, "clip_high": 0.28},  # DAPO clip-higher
        {"ratio": "sequence"},  # GSPO
        {"ratio": "sequence", "aggregation": "seq_mean_token_mean"},
    ],
)
def test_loss_variants_match_numpy(variant: dict[str, Any]) -> None:
    model = init_model(CFG, seed=0)
    b = _batch(model)
    logp = np.asarray(token_logprobs(model, jnp.asarray(b.tokens)))
    cfg = GRPOConfig(correction="tis", **variant)
    tx = cfg.optimizer()
    graphdef, state = init_state(model, tx, reference=False)
    _, metrics = make_train_step(graphdef, cfg, tx)(state, b)
    assert float(metrics["loss"]) == pytest.approx(
        _reference_loss(logp, b, cfg), rel=1e-4, abs=1e-5
    )


def test_log_probabilities_are_taken_at_the_sampling_temperature() -> None:
    """Samples drawn at temperature 0.7 record log-probabilities of the scaled policy: a
    trainer at the same temperature finds its own policy in them (importance weights 1,
    the loss of the scaled log-probabilities); one at 1 would take them for off-policy."""
    model = init_model(CFG, seed=0)
    b = _batch(model)
    scaled = np.asarray(token_logprobs(model, jnp.asarray(b.tokens), 0.7))
    on_policy = b._replace(behaviour=(scaled * b.mask).astype(np.float32))
    found = {}
    for temperature in (0.7, 1.0):
        cfg = GRPOConfig(correction="tis", temperature=temperature)
        tx = cfg.optimizer()
        graphdef, state = init_state(model, tx, reference=False)
        found[temperature] = make_train_step(graphdef, cfg, tx)(state, on_policy)[1]
        if temperature == 0.7:
            _, metrics = make_train_step(graphdef, cfg, tx)(state, b)
            assert float(metrics["loss"]) == pytest.approx(
                _reference_loss(scaled, b, cfg), rel=1e-4, abs=1e-5
            )
    assert abs(float(found[0.7]["kl_behaviour"])) < 1e-5
    assert float(found[0.7]["is_weight_max"]) == pytest.approx(1.0, abs=1e-4)
    assert abs(float(found[1.0]["kl_behaviour"])) > 0.05


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_to_a_reference_policy(estimator: str) -> None:
    model, other = init_model(CFG, seed=0), init_model(CFG, seed=1)
    b = _batch(model)
    logp = np.asarray(token_logprobs(model, jnp.asarray(b.tokens)))
    ref = np.asarray(token_logprobs(other, jnp.asarray(b.tokens)))
    cfg = GRPOConfig(correction="tis", kl_coef=0.5, kl_estimator=estimator)
    tx = cfg.optimizer()
    graphdef, state = init_state(model, tx)
    _, ref_params = init_state(other, tx)
    state = TrainState(state.params, state.opt_state, state.step, ref_params.params)
    _, metrics = make_train_step(graphdef, cfg, tx)(state, b)
    assert float(metrics["loss"]) == pytest.approx(
        _reference_loss(logp, b, cfg, ref), rel=1e-4, abs=1e-5
    )
    d = ref - logp
    kl = -d if estimator == "k1" else np.exp(d) - d - 1
    assert float(metrics["kl_ref"]) == pytest.approx((kl * b.mask).sum() / b.mask.sum(), rel=1e-4)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum"])
def test_micro_batches_give_the_update_of_the_whole_batch(aggregation: str) -> None:
    model = init_model(CFG, seed=0)
    b = _batch(model, rows=8)
    results = []
    for k in (1, 4):
        cfg = GRPOConfig(microbatches=k, aggregation=aggregation, warmup_steps=1)
        tx = cfg.optimizer()
        graphdef, state = init_state(model, tx, reference=False)
        state, metrics = make_train_step(graphdef, cfg, tx)(state, b)
        results.append((float(metrics["loss"]), float(metrics["grad_norm"]), state.params))
    (loss1, norm1, p1), (loss4, norm4, p4) = results
    assert loss4 == pytest.approx(loss1, rel=1e-5, abs=1e-6)
    assert norm4 == pytest.approx(norm1, rel=1e-4)
    for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(p4), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


def test_no_correction_takes_stale_samples_as_on_policy() -> None:
    """``none``: the loss is the plain policy gradient's, ``-mean(A)`` over policy tokens,
    and the update is the decoupled one of a batch whose behaviour is the trainer's own
    policy (its importance weights all 1), however stale the samples really are."""
    model = init_model(CFG, seed=0)
    stale = _batch(model)
    logp = np.asarray(token_logprobs(model, jnp.asarray(stale.tokens)))
    fresh = stale._replace(behaviour=(logp * stale.mask).astype(np.float32))
    results = []
    for correction, b in (("none", stale), ("decoupled", fresh)):
        cfg = GRPOConfig(correction=correction, warmup_steps=1, aggregation="token_mean")
        tx = cfg.optimizer()
        graphdef, state = init_state(model, tx, reference=False)
        state, metrics = make_train_step(graphdef, cfg, tx)(state, b)
        results.append((metrics, state.params))
    (m_none, p_none), (m_fresh, p_fresh) = results
    a, mask = stale.advantage[:, None], stale.mask
    assert float(m_none["loss"]) == pytest.approx(-(a * mask).sum() / mask.sum(), rel=1e-5)
    assert float(m_none["grad_norm"]) == pytest.approx(float(m_fresh["grad_norm"]), rel=1e-5)
    for x, y in zip(jax.tree.leaves(p_none), jax.tree.leaves(p_fresh), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)
    assert float(m_none["is_weight_max"]) > 1.2  # the samples were stale all the same


def test_unknown_variants_are_refused() -> None:
    from pipeline.errors import InvalidConfigError

    for bad in ({"advantage": "ppo"}, {"ratio": "row"}, {"kl_estimator": "k2"}):
        with pytest.raises(InvalidConfigError, match="must be one of"):
            GRPOConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfigError, match="overlong_buffer"):
        GRPOConfig(overlong_max_tokens=10, overlong_buffer=20)


@pytest.mark.parametrize("decay_steps", [0, 6])
def test_the_learning_rate_warms_up_then_decays_as_computed_by_hand(decay_steps: int) -> None:
    """Adam's first updates under a constant gradient move a parameter by exactly the
    learning rate, so the steps taken trace the schedule."""
    import optax

    cfg = GRPOConfig(learning_rate=0.01, warmup_steps=4, decay_steps=decay_steps, decay_floor=0.2)
    tx = cfg.optimizer()
    params = {"w": jnp.zeros(())}
    state = tx.init(params)
    taken = []
    for _ in range(12):
        updates, state = tx.update({"w": jnp.asarray(0.5)}, state, params)
        params = optax.apply_updates(params, updates)
        taken.append(-float(updates["w"]))
    expected = []
    for t in range(12):  # optax counts updates from 0
        if t < 4:
            expected.append(0.01 * t / 4)
        elif decay_steps == 0:
            expected.append(0.01)
        else:
            d = min(t - 4, decay_steps) / decay_steps
            expected.append(0.01 * (0.2 + 0.8 * 0.5 * (1 + np.cos(np.pi * d))))
    np.testing.assert_allclose(taken, expected, rtol=1e-5, atol=1e-9)
    from pipeline.errors import InvalidConfigError

    for bad in ({"decay_steps": -1}, {"decay_floor": 1.5}, {"decay_floor": float("nan")}):
        with pytest.raises(InvalidConfigError):
            GRPOConfig(**bad)  # type: ignore[arg-type]


def _groups(lengths: list[list[int]]) -> list[Any]:
    """Complete groups of trajectories of the given lengths, rewards varying."""
    rng = np.random.default_rng(3)
    buf, out = GroupBuffer(100, 10), []
    for gi, sizes in enumerate(lengths):
        for i, n in enumerate(sizes):
            t = make_trajectory(
                n,
                rng=rng,
                turns=4,
                group_id=f"g{gi}",
                group_size=len(sizes),
                group_index=i,
                reward=float(rng.random()),
            )
            done = buf.add(t, Coordinates("t", 0, gi * 10 + i, 0))
        out.append(done)
    return out


def test_packing_lays_trajectories_into_segments() -> None:
    groups = _groups([[30, 12, 50, 7], [20, 33, 9, 41]])
    batch, members = pack(groups, rows=4, length=64)
    assert rows_to_pack(groups, 64) == 4 and len(members) == 8
    assert batch.tokens.shape == (4, 64)
    for r in range(4):  # each segment's tokens, positions from 0, mask as recorded
        for seg in np.unique(batch.segment[r]):
            at = np.flatnonzero(batch.segment[r] == seg)
            assert (np.diff(at) == 1).all() and batch.position[r, at].tolist() == list(
                range(len(at))
            )
    for m in members:
        t = m.trajectory
        hits = [
            (r, c)
            for r in range(4)
            for c in range(64 - t.num_tokens + 1)
            if batch.tokens[r, c : c + t.num_tokens].tolist() == t.tokens.tolist()
        ]
        assert hits, t.trajectory_id
    real = sum(m.trajectory.num_tokens for m in members)
    assert real == 202 and (batch.segment < 4 * 64).all()
    with pytest.raises(ValueError, match="need"):
        pack(groups, rows=3, length=64)
    assert row_choices(64, 1) == [16, 32, 48, 64]
    assert row_choices(32, 3) == [9, 18, 27, 32]


@pytest.mark.parametrize(
    "variant",
    [
        {"aggregation": "token_mean"},
        {"aggregation": "seq_mean_token_mean", "correction": "tis"},
        {"aggregation": "seq_mean_token_sum", "microbatches": 2},
        {"ratio": "sequence", "kl_coef": 0.1},
        {"advantage": "gae"},
        {"advantage": "gae", "credit": "turn", "microbatches": 2},
    ],
)
def test_a_packed_batch_trains_exactly_as_one_row_per_trajectory(variant: dict[str, Any]) -> None:
    groups = _groups([[30, 12, 50, 7], [20, 33, 9, 41]])
    cfg = GRPOConfig(warmup_steps=1, **variant)
    bucketed, _ = assemble(groups, rows=8, buckets=(64,), grpo=cfg)
    packed, _ = pack(groups, rows=4, length=64, grpo=cfg)
    results = []
    for batch in (bucketed, packed):
        model = init_model(CFG, seed=0)
        tx = cfg.optimizer()
        critic = cfg.advantage == "gae"
        graphdef, state = init_state(model, tx, reference=cfg.kl_coef > 0, critic=critic)
        state, metrics = make_train_step(graphdef, cfg, tx)(state, batch)
        results.append((metrics, (state.params, state.critic)))
    (m1, p1), (m2, p2) = results
    for k in ("loss", "grad_norm", "entropy", "clip_fraction"):
        assert float(m2[k]) == pytest.approx(float(m1[k]), rel=1e-4, abs=1e-6), k
    for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-6)


def _gae_by_hand(
    v: np.ndarray, r: np.ndarray, m: np.ndarray, turns: list[list[int]], gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """GAE over the given steps (each a list of token indices; valued at its first token,
    rewarded with the sum over its tokens), by the textbook recursion."""
    adv, target = np.zeros_like(v), np.zeros_like(v)
    a_next = v_next = 0.0
    for step in reversed(turns):
        first = step[0]
        delta = sum(r[t] for t in step) + gamma * v_next - v[first]
        a = delta + gamma * lam * a_next
        for t in step:
            adv[t] = a * m[t]
        target[first] = a + v[first]
        a_next, v_next = a, v[first]
    return adv, target


@pytest.mark.parametrize("credit", ["token", "turn"])
def test_gae_matches_the_recursion_by_hand(credit: str) -> None:
    from pipeline.train.critic import gae

    rng = np.random.default_rng(0)
    # one row holding two sequences: tokens 0-9 (turns 2-4 and 7-8) and 10-15 (turn 12-14)
    mask = np.zeros((1, 16), np.float32)
    mask[0, [2, 3, 4, 7, 8, 12, 13, 14]] = 1
    segment = np.array([[0] * 10 + [10] * 6], np.int32)
    reward = np.zeros((1, 16), np.float32)
    reward[0, 8], reward[0, 14] = 1.0, -0.5
    value = rng.standard_normal((1, 16)).astype(np.float32)
    adv, target, steps = gae(
        jnp.asarray(value),
        jnp.asarray(reward),
        jnp.asarray(mask),
        jnp.asarray(segment),
        credit,
        0.9,
        0.8,
    )
    want_adv, want_target = np.zeros(16), np.zeros(16)
    for turns in ([[2, 3, 4], [7, 8]], [[12, 13, 14]]):
        if credit == "token":
            turns = [[t] for turn in turns for t in turn]
        a, tg = _gae_by_hand(value[0], reward[0], mask[0], turns, 0.9, 0.8)
        idx = [t for turn in turns for t in turn]
        want_adv[idx], want_target[[s[0] for s in turns]] = a[idx], tg[[s[0] for s in turns]]
    np.testing.assert_allclose(np.asarray(adv)[0], want_adv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(target)[0], want_target, rtol=1e-5, atol=1e-6)
    expected_steps = mask[0] if credit == "token" else np.isin(np.arange(16), [2, 7, 12])
    assert np.asarray(steps)[0].tolist() == expected_steps.astype(float).tolist()


def test_ppo_with_a_critic_learns_its_values_and_trains_from_packed_rows() -> None:
    groups = _groups([[30, 12, 50, 7], [20, 33, 9, 41]])
    cfg = GRPOConfig(advantage="gae", credit="turn", warmup_steps=1, learning_rate=1e-2)
    batch, _ = pack(groups, rows=4, length=64, grpo=cfg)
    assert batch.reward is not None and np.count_nonzero(batch.reward) <= 8
    tx = cfg.optimizer()
    graphdef, state = init_state(init_model(CFG, seed=0), tx, reference=False, critic=True)
    assert state.critic is not None
    step = make_train_step(graphdef, cfg, tx)
    losses = []
    for _ in range(30):
        state, metrics = step(state, batch)
        assert float(metrics["applied"]) == 1.0
        losses.append(float(metrics["value_loss"]))
    assert losses[-1] < 0.2 * losses[0], losses  # the critic fits the returns it sees
    assert float(jnp.abs(state.critic["w"]).sum()) > 0


def test_a_kl_term_trains_with_a_donated_state_and_keeps_its_reference() -> None:
    """The trainer donates its state to each step; with a KL term the state holds the
    reference beside the parameters, and a donated state may not hold one buffer twice
    (XLA refuses it). Two donated steps run; the reference stays the initial parameters
    while the parameters move."""
    groups = _groups([[30, 12, 50, 7], [20, 33, 9, 41]])
    cfg = GRPOConfig(warmup_steps=1, kl_coef=0.1)
    batch, _ = pack(groups, rows=4, length=64, grpo=cfg)
    model = init_model(CFG, seed=0)
    tx = cfg.optimizer()
    graphdef, state = init_state(model, tx, reference=True)
    initial = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    step = make_train_step(graphdef, cfg, tx, donate=True)
    for _ in range(2):
        state, metrics = step(state, batch)
        assert np.isfinite(float(metrics["loss"]))
    for x, y in zip(initial, jax.tree.leaves(state.reference), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    moved = [
        not np.array_equal(x, np.asarray(y))
        for x, y in zip(initial, jax.tree.leaves(state.params), strict=True)
    ]
    assert any(moved)
