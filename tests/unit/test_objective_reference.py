"""Every loss variant against an independent float64 numpy implementation written from the
papers' formulas: the loss and its gradient, on random off-policy batches where the
behaviour policy (the producer's, several versions old), the proximal policy (the trainer's
at the start of the step) and the current policy all differ.

The gradient is taken with respect to the current log-probabilities of the batch's tokens:
the loss reaches the parameters through them alone (the chain through the model is the
model's own autodiff, compared with transformers elsewhere), and the last test checks that
chain once, end to end, on a real update. Each reference differentiates its formula by
hand, so neither side borrows the other's automatic differentiation.

Formulas:

- PPO's clipped surrogate: Schulman et al. 2017, "Proximal Policy Optimization
  Algorithms", eq. 7: ``min(r A, clip(r, 1 - eps, 1 + eps) A)``.
- Clip-higher (separate ``eps_low``/``eps_high``): Yu et al. 2025, "DAPO", eq. 10.
- The decoupled objective (the clipped ratio against a proximal policy, each token weighted
  by ``prox / behaviour``): Hilton et al. 2022, "Batch size-invariance for policy
  optimization", sec. 3; its importance weight truncated at ``is_cap`` as in Espeholt et al.
  2018, "IMPALA" (the truncated weight ``min(c, pi / mu)``).
- Truncated importance sampling against the behaviour policy itself (``tis``): the same
  surrogate with ``r = pi / mu`` and the unclipped branch truncated at ``is_cap``.
- GSPO-token: Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 12-13: each
  token's ratio is ``sg[s_i] * pi_t / sg[pi_t]`` with ``s_i`` the sequence's
  length-normalised ratio, so its value is ``s_i`` and its gradient the token's own.
- Aggregations: the token mean of DAPO (eq. 8), the sequence mean of token means of GRPO
  (Shao et al. 2024, "DeepSeekMath", eq. 3) and the sequence mean of token sums of Dr. GRPO
  (Liu et al. 2025, "Understanding R1-Zero-Like Training", eq. 5).
- Advantages: GRPO's ``(r - mean) / std`` (DeepSeekMath, sec. 4.1.2), Dr. GRPO's
  ``r - mean`` (Liu et al. 2025, sec. 3.2), RLOO's leave-one-out baseline (Ahmadian et al.
  2024, "Back to Basics", eq. 5).
- KL estimators k1 = ``log pi - log ref`` and k3 = ``ref/pi - log(ref/pi) - 1``: Schulman
  2020, "Approximating KL Divergence".
- GAE: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
  Advantage Estimation", eq. 16; the value loss ``1/2 (V - (A + V_old))^2`` (PPO, eq. 9).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.train.advantages import advantages
from pipeline.train.config import GRPOConfig
from pipeline.train.critic import gae
from pipeline.train.objective import Batch, critic_loss, denominators, policy_loss

ROWS, T = 6, 14
TOL = 1e-5


def _off_policy_batch(seed: int) -> tuple[Batch, np.ndarray, np.ndarray]:
    """A batch of ``ROWS`` sequences (one a row, of different lengths, one with no policy
    tokens), its current and its proximal log-probabilities: the proximal policy 0.25 nats
    per token from the current one, the behaviour policy 0.5 from the proximal one, so ratios
    fall inside and outside every clip range and some importance weights pass the cap."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((ROWS, T), np.float32)
    for i in range(ROWS - 1):
        start = int(rng.integers(1, T // 2))
        mask[i, start : start + int(rng.integers(2, T - start + 1))] = 1
    logp = -rng.gamma(2.0, 0.7, (ROWS, T)).astype(np.float32)
    prox = (logp + rng.normal(0, 0.25, logp.shape)).astype(np.float32)
    behaviour = ((prox + rng.normal(0, 0.5, logp.shape)) * mask).astype(np.float32)
    adv = rng.standard_normal(ROWS).astype(np.float32)
    b = Batch(jnp.zeros((ROWS, T), jnp.int32), mask, behaviour, adv, np.ones(ROWS, np.float32))
    return b.per_token(), logp, prox


def _reference(
    cfg: GRPOConfig,
    logp: np.ndarray,
    prox: np.ndarray,
    mu: np.ndarray,
    adv: np.ndarray,
    m: np.ndarray,
    ref: np.ndarray | None,
) -> tuple[float, np.ndarray]:
    """The loss and its gradient with respect to ``logp``, in float64, by hand."""
    logp, prox, mu, m = (x.astype(np.float64) for x in (logp, prox, mu, m))
    a = np.broadcast_to(adv.astype(np.float64)[:, None], logp.shape)
    lens = m.sum(1)
    anchor = mu if cfg.correction == "tis" else prox
    if cfg.ratio == "sequence":  # GSPO: s_i = exp(mean_t (log pi - log anchor))
        seq = ((logp - anchor) * m).sum(1) / np.maximum(lens, 1)
        r = np.broadcast_to(np.exp(seq)[:, None], logp.shape)
    else:
        r = np.exp(logp - anchor)
    # d r / d log pi_t: r itself (the sequence ratio too, through the token's own term)
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    clipped = np.clip(r, lo, hi) * a
    d_clipped = np.where((r > lo) & (r < hi), r * a, 0.0)
    if cfg.correction == "tis":
        unclipped = np.minimum(r, cfg.is_cap) * a
        d_unclipped = np.where(r < cfg.is_cap, r * a, 0.0)
    else:
        unclipped = r * a
        d_unclipped = r * a
    w = np.minimum(np.exp(prox - mu), cfg.is_cap) if cfg.correction == "decoupled" else 1.0
    take_unclipped = unclipped <= clipped
    per = -w * np.where(take_unclipped, unclipped, clipped)
    d_per = -w * np.where(take_unclipped, d_unclipped, d_clipped)
    if ref is not None:
        d = ref.astype(np.float64) - logp
        if cfg.kl_estimator == "k1":
            per = per - cfg.kl_coef * d
            d_per = d_per + cfg.kl_coef
        else:
            per = per + cfg.kl_coef * (np.exp(d) - d - 1)
            d_per = d_per + cfg.kl_coef * (1 - np.exp(d))
    if cfg.aggregation == "token_mean":
        scale = m / m.sum()
    else:
        sequences = (lens > 0).sum()
        per_seq = np.where(lens > 0, 1 / np.maximum(lens, 1), 0.0)
        rows = per_seq if cfg.aggregation == "seq_mean_token_mean" else (lens > 0) * 1.0
        scale = m * rows[:, None] / sequences
    return float((per * scale).sum()), d_per * scale


VARIANTS: list[dict[str, Any]] = [
    {"correction": c, "aggregation": g}
    for c in ("tis", "decoupled", "none")
    for g in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
] + [
    {"correction": "decoupled", "clip_low": 0.2, "clip_high": 0.2},  # symmetric PPO clip
    {"correction": "decoupled", "clip_low": 0.2, "clip_high": 0.28},  # DAPO clip-higher
    {"correction": "tis", "clip_low": 0.1, "clip_high": 0.4, "is_cap": 1.5},
    {"correction": "decoupled", "ratio": "sequence"},  # GSPO-token
    {"correction": "tis", "ratio": "sequence", "aggregation": "seq_mean_token_sum"},
    {"correction": "decoupled", "kl_coef": 0.3, "kl_estimator": "k1"},
    {"correction": "tis", "kl_coef": 0.3, "kl_estimator": "k3", "aggregation": "token_mean"},
]


@pytest.mark.parametrize(
    "variant", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items())
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_match_the_formulas_off_policy(
    variant: dict[str, Any], seed: int
) -> None:
    cfg = GRPOConfig(**variant)
    b, logp, prox = _off_policy_batch(seed)
    ref = (logp + np.random.default_rng(seed + 100).normal(0, 0.3, logp.shape)).astype(np.float32)
    ref_or_none = ref if cfg.kl_coef else None
    n = ROWS * T
    denom = denominators(b.mask, b.segment, n)

    def loss(x: jax.Array) -> jax.Array:
        value, _ = policy_loss(
            cfg,
            x,
            jnp.asarray(prox),
            b,
            None if ref_or_none is None else jnp.asarray(ref),
            denom,
            n,
        )
        return value

    value, grad = jax.value_and_grad(loss)(jnp.asarray(logp))
    want, want_grad = _reference(
        cfg,
        logp,
        prox,
        np.asarray(b.behaviour),
        np.asarray(b.advantage)[:, 0],
        np.asarray(b.mask),
        ref_or_none,
    )
    assert float(value) == pytest.approx(want, abs=TOL, rel=TOL)
    np.testing.assert_allclose(np.asarray(grad), want_grad, atol=TOL, rtol=TOL)
    # the batch was off-policy in every way the variants tell apart
    w = np.exp(prox - np.asarray(b.behaviour))[np.asarray(b.mask) > 0]
    assert (w > cfg.is_cap).any() and (w < 1 - cfg.clip_low).any()
    r = np.exp(logp - prox)[np.asarray(b.mask) > 0]
    assert ((r < 1 - cfg.clip_low) | (r > 1 + cfg.clip_high)).any()
    assert ((r > 1 - cfg.clip_low) & (r < 1 + cfg.clip_high)).any()


def test_the_three_corrections_differ_off_policy_and_agree_on_policy() -> None:
    """A reference test that a variant could pass by being another: off-policy the three
    corrections give three different gradients; with behaviour = proximal = current they
    give one."""
    b, logp, prox = _off_policy_batch(3)
    n = ROWS * T
    denom = denominators(b.mask, b.segment, n)

    def grad(correction: str, batch: Batch, p: np.ndarray) -> np.ndarray:
        cfg = GRPOConfig(correction=correction)
        return np.asarray(
            jax.grad(lambda x: policy_loss(cfg, x, jnp.asarray(p), batch, None, denom, n)[0])(
                jnp.asarray(logp)
            )
        )

    off = [grad(c, b, prox) for c in ("tis", "decoupled", "none")]
    for i in range(3):
        for j in range(i + 1, 3):
            assert np.abs(off[i] - off[j]).max() > 1e-3
    on = b._replace(behaviour=jnp.asarray(logp) * b.mask)
    same = [grad(c, on, logp) for c in ("tis", "decoupled", "none")]
    for g in same[1:]:
        np.testing.assert_allclose(g, same[0], atol=1e-7)


@pytest.mark.parametrize("how", ["grpo", "drgrpo", "rloo"])
def test_group_advantages_match_the_formulas(how: str) -> None:
    rng = np.random.default_rng(7)
    for size in (2, 5, 16):
        r = rng.random(size)
        mean = sum(r) / size
        if how == "grpo":
            std = (sum((x - mean) ** 2 for x in r) / size) ** 0.5
            want = [(x - mean) / (std + 1e-6) for x in r]
        elif how == "drgrpo":
            want = [x - mean for x in r]
        else:
            want = [x - (sum(r) - x) / (size - 1) for x in r]
        np.testing.assert_allclose(advantages(r, how), want, rtol=1e-12, atol=1e-12)


def _gae_reference(
    values: np.ndarray, rewards: np.ndarray, mask: np.ndarray, gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """GAE over each row's policy tokens (one sequence a row, ``credit=token``), written as
    the sum of eq. 16: ``A_t = sum_l (gamma lam)^l delta_{t+l}``."""
    adv, target = np.zeros_like(values), np.zeros_like(values)
    for i in range(values.shape[0]):
        idx = np.flatnonzero(mask[i])
        v = values[i, idx]
        r = np.zeros(len(idx))
        for k, t in enumerate(idx):  # rewards on environment tokens fold into the step before
            end = idx[k + 1] if k + 1 < len(idx) else values.shape[1]
            r[k] = rewards[i, t:end].sum()
        v_next = np.append(v[1:], 0.0)
        delta = r + gamma * v_next - v
        for k, t in enumerate(idx):
            a = sum((gamma * lam) ** j * delta[k + j] for j in range(len(idx) - k))
            adv[i, t], target[i, t] = a, a + v[k]
    return adv, target


def test_gae_and_the_value_loss_match_the_formulas() -> None:
    rng = np.random.default_rng(11)
    b, _, _ = _off_policy_batch(4)
    mask = np.asarray(b.mask)
    values = rng.standard_normal((ROWS, T)).astype(np.float32)
    rewards = np.zeros((ROWS, T), np.float32)
    for i in range(ROWS):
        idx = np.flatnonzero(mask[i])
        if len(idx):
            rewards[i, idx[-1]] = rng.random()
    gamma, lam = 0.97, 0.9
    adv, target, steps = gae(
        jnp.asarray(values), jnp.asarray(rewards), b.mask, b.segment, "token", gamma, lam
    )
    want_adv, want_target = _gae_reference(values, rewards, mask, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), want_adv, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(np.asarray(target) * mask, want_target, atol=TOL, rtol=TOL)
    # the value loss and its gradient: 1/2 mean over steps of (V - target)^2
    n = ROWS * T
    denom = denominators(b.mask, b.segment, n, steps)
    new_values = values + rng.normal(0, 0.5, values.shape).astype(np.float32)
    value, grad = jax.value_and_grad(lambda v: critic_loss(v, target, steps, denom))(
        jnp.asarray(new_values)
    )
    err = (new_values.astype(np.float64) - want_target) * mask
    assert float(value) == pytest.approx(0.5 * (err**2).sum() / mask.sum(), rel=TOL)
    np.testing.assert_allclose(np.asarray(grad), err / mask.sum(), atol=TOL)


def test_the_update_of_a_real_step_is_the_reference_gradient_through_the_model() -> None:
    """End to end: one ``train_step`` of plain SGD at rate 1 moves the parameters by minus
    the reference gradient (taken with respect to the log-probabilities, by hand) carried
    through the model's log-probabilities; behaviour != current policy."""
    import optax
    from flax import nnx

    from pipeline.policy.config import ModelConfig
    from pipeline.policy.model import init_model, token_logprobs
    from pipeline.train.grpo import init_state, make_train_step

    cfg_model = ModelConfig(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=64)
    model = init_model(cfg_model, seed=0)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 256, (ROWS, T)).astype(np.int32)
    b, _, _ = _off_policy_batch(5)
    mask = np.asarray(b.mask)
    logp = np.asarray(token_logprobs(model, jnp.asarray(tokens)))
    behaviour = ((logp + rng.normal(0, 0.3, logp.shape)) * mask).astype(np.float32)
    adv = np.asarray(b.advantage)[:, 0]
    batch = Batch(tokens, mask, behaviour, adv, np.ones(ROWS, np.float32))
    for correction in ("tis", "decoupled"):
        cfg = GRPOConfig(correction=correction, aggregation="seq_mean_token_mean")
        tx = optax.sgd(1.0)
        graphdef, state = init_state(model, tx, reference=False)
        new, _ = make_train_step(graphdef, cfg, tx)(state, batch)
        _, g_logp = _reference(cfg, logp, logp, behaviour, adv, mask, None)
        _, pull = jax.vjp(
            lambda p, g=graphdef: token_logprobs(nnx.merge(g, p), jnp.asarray(tokens)),
            state.params,
        )
        (want,) = pull(jnp.asarray(g_logp, jnp.float32))
        moved = jax.tree.map(lambda a, c: a - c, state.params, new.params)
        for got, exp in zip(jax.tree.leaves(moved), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(exp), atol=TOL, rtol=1e-4)
