"""The sampler's log-probabilities are those of a full forward pass; shapes are fixed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.errors import InvalidConfigError
from pipeline.policy.config import ModelConfig, SamplingConfig
from pipeline.policy.model import init_model, token_logprobs
from pipeline.policy.sampler import DecodeEngine, sample_tokens

CFG = ModelConfig(d_model=32, num_layers=2, num_heads=2, d_ff=64, max_len=64)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_full_forward_pass(temperature: float) -> None:
    model = init_model(CFG, seed=1)
    engine = DecodeEngine(
        model, slots=3, sampling=SamplingConfig(temperature, 0.9, seed=2), chunk=4
    )
    seqs = {0: [257, 1, 2, 3, 4, 5, 6], 1: [257], 2: list(range(20))}
    for s, t in seqs.items():
        engine.append(s, list(t))
    sampled: dict[int, list[float]] = {s: [] for s in seqs}
    for i in range(10):
        if i == 4:  # an observation arrives in the middle, for slot 0 only
            engine.append(0, [9, 8, 7])
            seqs[0] += [9, 8, 7]
            sampled[0] += [None, None, None]  # type: ignore[list-item]
        for s, (tok, lp, _) in engine.step(list(seqs)).items():
            seqs[s].append(tok)
            sampled[s].append(lp)
    for s, toks in seqs.items():
        full = np.asarray(token_logprobs(model, jnp.asarray([toks]), temperature)[0])
        got = sampled[s]
        want = full[-len(got) :]
        for g, w in zip(got, want, strict=True):
            if g is not None:
                assert abs(g - w) < 1e-4


def test_greedy_is_deterministic_and_seeded_sampling_repeats() -> None:
    model = init_model(CFG, seed=0)

    def run(sampling: SamplingConfig) -> list[int]:
        engine = DecodeEngine(model, slots=1, sampling=sampling)
        engine.append(0, [257, 3])
        return [engine.step([0])[0][0] for _ in range(8)]

    assert run(SamplingConfig(0.0)) == run(SamplingConfig(0.0, seed=9))
    assert run(SamplingConfig(1.0, seed=5)) == run(SamplingConfig(1.0, seed=5))


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = jnp.log(jnp.asarray([[0.6, 0.3, 0.05, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 200)
    drawn = {int(sample_tokens(logits, k, 1.0, 0.8)[0][0]) for k in keys}
    assert drawn == {0, 1}
    tok, lp = sample_tokens(logits, keys[0], 1.0, 1.0)
    assert abs(float(lp[0]) - float(jnp.log(jnp.asarray([0.6, 0.3, 0.05, 0.05])[tok[0]]))) < 1e-5


def test_steps_do_not_recompile() -> None:
    model = init_model(CFG, seed=0)
    engine = DecodeEngine(model, slots=4, chunk=4)
    for s in range(4):
        engine.append(s, [257, s])
    engine.step([0, 1, 2, 3])

    def vary() -> None:
        for i in range(6):
            engine.append(i % 4, list(range(i + 1)))  # prefills of varying length
            if i % 3 == 0:  # and of several slots at once
                engine.append((i + 2) % 4, [1, 2])
            engine.step([i % 4, (i + 1) % 4])  # varying subsets of slots

    vary()
    compiled = engine._decode._cache_size(), engine._prefill._cache_size()
    assert compiled[0] == 1 and compiled[1] <= 3  # prefills of 1, 2 and 4 rows
    vary()
    assert (engine._decode._cache_size(), engine._prefill._cache_size()) == compiled


def test_swap_changes_the_policy_and_the_version() -> None:
    from flax import nnx

    a, b = init_model(CFG, seed=0), init_model(CFG, seed=1)
    engine = DecodeEngine(a, slots=1, sampling=SamplingConfig(0.0))
    engine.append(0, [257, 4, 5])
    v = engine.step([0])[0][2]
    assert v == 0
    engine.reset(0)
    engine.append(0, [257, 4, 5])
    engine.swap(nnx.split(b)[1], 7)
    tok, lp_b, v = engine.step([0])[0]
    assert v == 7
    full = token_logprobs(b, jnp.asarray([[257, 4, 5, tok]]))[0, -1]
    assert abs(float(full) - lp_b) < 1e-4


def test_swapping_in_a_restored_checkpoint_does_not_recompile(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pipeline.policy.checkpoint import restore_params, save_params

    engine = DecodeEngine(init_model(CFG, seed=0), slots=2, chunk=4)
    for s in range(2):
        engine.append(s, [257, s, 3])
    engine.step([0, 1])
    engine.append(0, [4, 5])  # (a prefill of one row: its own shape)
    engine.step([0, 1])
    compiled = engine._decode._cache_size(), engine._prefill._cache_size()
    save_params(tmp_path / "ckpt", init_model(CFG, seed=1))
    engine.swap(restore_params(tmp_path / "ckpt", CFG), 1)
    for _ in range(3):
        engine.append(0, [4, 5])
        assert engine.step([0, 1])[0][2] == 1
    assert (engine._decode._cache_size(), engine._prefill._cache_size()) == compiled


def test_stop_sequences_end_a_turn() -> None:
    import asyncio

    from pipeline.policy.server import PolicyServer

    model = init_model(CFG, seed=0)

    def turn(stops: tuple[tuple[int, ...], ...]) -> list[int]:
        engine = DecodeEngine(model, slots=1, sampling=SamplingConfig(0.0))
        server = PolicyServer(engine, set(), stop_sequences=stops).start()
        try:
            r = asyncio.run(server.generate(0, [257, 10, 11], 12, reset=True))
        finally:
            server.stop()
        return r.tokens

    free = turn(())
    assert len(free) == 12
    stop = tuple(free[2:4])
    first_end = next(k for k in range(2, 13) if tuple(free[k - 2 : k]) == stop)
    assert turn((stop,)) == free[:first_end]


def test_an_idle_policy_server_takes_new_weights_at_once() -> None:
    """A synchronous producer waits for the next version with nothing to generate: the
    swap must not wait for the next request, or it would wait forever."""
    import time

    from flax import nnx

    from pipeline.policy.server import PolicyServer

    engine = DecodeEngine(init_model(CFG, seed=0), slots=1, sampling=SamplingConfig(0.0))
    server = PolicyServer(engine, set()).start()
    try:
        server.swap(nnx.split(init_model(CFG, seed=1))[1], 3)
        deadline = time.monotonic() + 10
        while server.version != 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.version == 3
    finally:
        server.stop()


def test_ids_past_the_tokenizer_are_never_sampled_nor_given_mass() -> None:
    """A checkpoint whose output layer is padded past its tokenizer (``output_vocab``)
    never samples a padded id, greedy or not, even when those rows would win; the
    trainer's log-probabilities (the same logits) give them no mass either."""
    import dataclasses

    from flax import nnx

    cfg = dataclasses.replace(CFG, output_vocab=200)
    model = init_model(cfg, seed=0)
    graphdef, state = nnx.split(model)
    table = np.array(state["embed"]["embedding"][...])
    table[200:] = 50.0 * np.sign(table[200:])  # the padded rows dominate every logit
    state["embed"]["embedding"] = nnx.Param(jnp.asarray(table))
    model = nnx.merge(graphdef, state)
    unmasked = nnx.merge(graphdef, state)
    unmasked.cfg = CFG
    x, _ = unmasked.features(jnp.asarray([[257, 3]]), jnp.asarray([[0, 1]]))
    assert int(jnp.argmax(unmasked.logits(x)[0, -1])) >= 200  # what the mask prevents
    for temperature in (0.0, 1.0, 0.3):
        engine = DecodeEngine(model, slots=4, sampling=SamplingConfig(temperature, seed=3))
        for s in range(4):
            engine.append(s, [257, s + 1])
        drawn = [t for _ in range(12) for t, _, _ in engine.step([0, 1, 2, 3]).values()]
        assert max(drawn) < 200, (temperature, max(drawn))
    logits, _ = model(jnp.asarray([[257, 3, 4]]), jnp.asarray([[0, 1, 2]]))
    mass = jax.nn.logsumexp(jax.nn.log_softmax(logits[0].astype(jnp.float32))[:, :200], -1)
    assert np.allclose(np.asarray(mass), 0.0, atol=1e-6)


def test_the_engine_refuses_what_does_not_fit_and_ids_it_has_no_row_for() -> None:
    engine = DecodeEngine(init_model(CFG, seed=0), slots=2, chunk=4)
    engine.append(1, [257, 1])
    with pytest.raises(
        InvalidConfigError, match=r"65536 tokens do not fit in slot 0: it has room for 64"
    ):
        engine.append(0, [1] * 65536)
    engine.append(0, [1] * 60)
    with pytest.raises(
        InvalidConfigError, match=r"5 tokens do not fit in slot 0: it has room for 4"
    ):
        engine.append(0, [1] * 5)
    for bad in ([-1], [CFG.vocab_size], [3, 2**31]):
        with pytest.raises(InvalidConfigError, match="outside the model's"):
            engine.append(1, bad)
    assert len(engine.step([0, 1])) == 2  # the refusals queued nothing


def test_a_conversation_draws_the_same_tokens_in_any_slot_and_batch() -> None:
    model = init_model(CFG, seed=0)
    prompt = [257, 4, 9, 2]

    def draw(slots: int, slot: int, neighbours: int) -> list[int]:
        engine = DecodeEngine(model, slots=slots, chunk=4, sampling=SamplingConfig(1.0, seed=3))
        others = [s for s in range(slots) if s != slot][:neighbours]
        for n, s in enumerate(others):  # other conversations, of other lengths, alongside
            engine.reset(s)
            engine.append(s, [257, *range(n + 1)])
        engine.reset(slot, stream=77)
        engine.append(slot, prompt)
        out = []
        for i in range(10):
            out.append(engine.step([slot, *others[: i % (len(others) + 1)]])[slot][0])
        return out

    alone = draw(1, 0, 0)
    assert draw(4, 2, 3) == alone
    assert draw(8, 7, 5) == alone
    engine = DecodeEngine(model, slots=1, chunk=4, sampling=SamplingConfig(1.0, seed=3))
    engine.reset(0, stream=78)  # another stream draws otherwise
    engine.append(0, prompt)
    assert [engine.step([0])[0][0] for _ in range(10)] != alone
    with pytest.raises(InvalidConfigError, match="stream"):
        engine.reset(0, stream=1 << 32)


def test_held_out_evaluation_gives_the_same_episodes_at_any_concurrency(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from pipeline.rollout import evaluate as evaluation

    played: list[tuple[str, tuple[int, ...]]] = []
    real = evaluation.run_episode

    async def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = await real(*args, **kwargs)
        played.append((t.group_id, tuple(t.tokens.tolist())))
        return t

    monkeypatch.setattr(evaluation, "run_episode", recorded)
    small = ModelConfig(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=128)

    def episodes(concurrency: int, seed: int = 1) -> dict[str, tuple[int, ...]]:
        played.clear()
        evaluation.evaluate(
            "guess", model=small, episodes=24, concurrency=concurrency, seed=seed, model_seed=2
        )
        return dict(played)

    once = episodes(3)
    assert len(once) == 24 and len(set(once.values())) == 24  # sampled, all different
    assert episodes(8) == once
    assert episodes(24) == once
    assert episodes(8, seed=2) != once


def test_a_group_prompt_is_prefilled_once_and_samples_as_if_each_had_its_own() -> None:
    """Slots that start with the same tokens (a GRPO group's members) are prefilled
    once and share the cache rows: each draws what it draws alone, the copy is not
    aliased (the members diverge), and nothing recompiles from one flush to the next."""
    model = init_model(CFG, seed=0)
    prompt = [257, *range(1, 11)]  # longer than a chunk
    sampling = SamplingConfig(1.0, seed=3)

    def alone(stream: int) -> list[tuple[int, float]]:
        engine = DecodeEngine(model, slots=1, chunk=4, sampling=sampling)
        engine.reset(0, stream=stream)
        engine.append(0, prompt)
        return [engine.step([0])[0][:2] for _ in range(8)]

    engine = DecodeEngine(model, slots=5, chunk=4, sampling=sampling)
    for s in range(5):
        engine.reset(s, stream=100 + s)
        engine.append(s, prompt if s != 3 else [257, 5, 5])
    drawn: dict[int, list[tuple[int, float]]] = {s: [] for s in range(5)}
    for _ in range(8):
        for s, (tok, lp, _) in engine.step(list(range(5))).items():
            drawn[s].append((tok, lp))
    assert engine.shared_prompt_tokens == 3 * (len(prompt) - 1)
    for s in (0, 1, 2, 4):
        want = alone(100 + s)
        assert [t for t, _ in drawn[s]] == [t for t, _ in want]
        assert np.allclose([lp for _, lp in drawn[s]], [lp for _, lp in want], atol=1e-5)
    assert len({tuple(t for t, _ in drawn[s]) for s in (0, 1, 2, 4)}) > 1
    shared = engine.shared_prompt_tokens
    compiled = engine._copy_rows._cache_size(), engine._prefill._cache_size()
    for s in (0, 2):  # a second group of another size, later
        engine.reset(s, stream=200 + s)
        engine.append(s, [257, 7, 7, 7, 7, 7])
    engine.step([0, 2])
    shared += 5
    assert engine.shared_prompt_tokens == shared
    # a member that starts after the others took their first steps: the rows of the
    # prompt come from a slot that holds it (slot 1, which has decoded past it)
    engine.reset(3, stream=104)
    engine.append(3, prompt)
    late = [engine.step([3])[3][:2] for _ in range(8)]
    shared += len(prompt) - 1
    assert engine.shared_prompt_tokens == shared
    assert [t for t, _ in late] == [t for t, _ in drawn[4]]
    assert (engine._copy_rows._cache_size(), engine._prefill._cache_size()) == compiled
    # after a swap no row was computed with the new parameters: nothing is copied
    engine.swap(engine.state, 1)
    engine.reset(3, stream=104)
    engine.append(3, prompt)
    assert [engine.step([3])[3][0] for _ in range(8)] == [t for t, _ in late]
    assert engine.shared_prompt_tokens == shared


def test_draws_follow_the_distribution_across_blocks() -> None:
    # 600 entries: three blocks of the two-level draw, mass in all of them
    probs = np.zeros(600)
    probs[[3, 250, 260, 511, 599]] = [0.1, 0.2, 0.3, 0.15, 0.25]
    logits = jnp.log(jnp.asarray(probs, jnp.float32))[None].repeat(20_000, axis=0)
    keys = jax.random.split(jax.random.key(3), 20_000)
    tokens, logp = sample_tokens(logits, keys, 1.0, 1.0)
    counts = np.bincount(np.asarray(tokens), minlength=600)
    assert counts.sum() == 20_000 and set(np.flatnonzero(counts)) <= {3, 250, 260, 511, 599}
    expected = probs * 20_000
    chi2 = float((((counts - expected) ** 2)[expected > 0] / expected[expected > 0]).sum())
    assert chi2 < 20.5  # 4 degrees of freedom: p < 0.0005 by chance
    np.testing.assert_allclose(np.exp(np.asarray(logp)), probs[np.asarray(tokens)], rtol=1e-5)


def test_temperature_and_top_p_as_traced_values_or_constants_draw_alike() -> None:
    logits = jax.random.normal(jax.random.key(0), (64, 700)) * 3
    keys = jax.random.split(jax.random.key(1), 64)
    for temperature, top_p in ((0.7, 0.9), (1.0, 1.0)):
        constant = jax.jit(lambda lg, k, tp=top_p, t=temperature: sample_tokens(lg, k, t, tp))
        traced = jax.jit(sample_tokens)
        a, b = constant(logits, keys), traced(logits, keys, temperature, top_p)
        np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
        np.testing.assert_allclose(np.asarray(a[1]), np.asarray(b[1]), rtol=1e-6)


def test_greedy_takes_the_first_of_tied_maxima_and_survives_a_nan_row() -> None:
    logits = jnp.asarray([[0.0, 5.0, 1.0, 5.0], [2.0, 1.0, 0.0, 2.0], [jnp.nan] * 4])
    tokens, _ = sample_tokens(logits, jax.random.key(0), 0.0, 1.0)
    assert np.asarray(tokens)[:2].tolist() == [1, 0]
    assert 0 <= int(tokens[2]) < 4  # a token of the vocabulary, whatever it is


def test_recompute_at_a_swap_decodes_as_a_fresh_engine_under_the_new_weights() -> None:
    from flax import nnx

    a, b = init_model(CFG, seed=0), init_model(CFG, seed=1)
    prompts = {0: [257, 4, 5, 6], 1: [257, 9], 2: [257, 4, 5, 6]}  # 2 shares 0's prompt

    def continue_after_swap(swap_kv: str) -> tuple[dict[int, list[int]], dict[int, list[float]]]:
        engine = DecodeEngine(a, slots=3, sampling=SamplingConfig(0.0), chunk=4, swap_kv=swap_kv)
        seqs = {s: list(p) for s, p in prompts.items()}
        for s, p in prompts.items():
            engine.append(s, p)
        for _ in range(3):  # tokens of version 0, in the cache of the old weights
            for s, (tok, _, v) in engine.step(list(seqs)).items():
                assert v == 0
                seqs[s].append(tok)
        engine.append(1, [7, 8])  # an observation queued before the swap
        seqs[1] += [7, 8]
        engine.swap(nnx.split(b)[1], 1)
        after: dict[int, list[int]] = {s: [] for s in seqs}
        lps: dict[int, list[float]] = {s: [] for s in seqs}
        for _ in range(4):
            for s, (tok, lp, v) in engine.step(list(seqs)).items():
                assert v == 1
                after[s].append(tok)
                lps[s].append(lp)
        return after | {s + 10: seqs[s] for s in seqs}, lps

    got, got_lp = continue_after_swap("recompute")
    fresh = DecodeEngine(b, slots=3, sampling=SamplingConfig(0.0), chunk=4)
    for s in range(3):
        fresh.append(s, got[s + 10])
    want: dict[int, list[int]] = {s: [] for s in range(3)}
    want_lp: dict[int, list[float]] = {s: [] for s in range(3)}
    for _ in range(4):
        for s, (tok, lp, _) in fresh.step([0, 1, 2]).items():
            want[s].append(tok)
            want_lp[s].append(lp)
    assert {s: got[s] for s in range(3)} == want
    for s in range(3):
        np.testing.assert_allclose(got_lp[s], want_lp[s], atol=1e-4)
    _, kept_lp = continue_after_swap("keep")  # the old rows stay: other log-probabilities
    assert any(
        abs(x - y) > 1e-3 for s in range(3) for x, y in zip(kept_lp[s], want_lp[s], strict=True)
    )


def test_an_unknown_swap_kv_is_refused() -> None:
    with pytest.raises(InvalidConfigError, match="swap_kv must be one of keep, recompute"):
        DecodeEngine(init_model(CFG, seed=0), slots=1, swap_kv="refresh")
