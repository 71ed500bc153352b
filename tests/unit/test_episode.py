"""Episodes: token in, token out; failures end one episode only; tool calls."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from connectors.base import Environment, Step, Task, make
from pipeline.policy.config import ModelConfig, SamplingConfig
from pipeline.policy.model import init_model, token_logprobs
from pipeline.policy.sampler import DecodeEngine
from pipeline.policy.server import PolicyServer
from pipeline.policy.tokenizer import ByteTokenizer
from pipeline.records.codec import TrajectoryCodec
from pipeline.records.trajectory import META_TEMPERATURE
from pipeline.rollout.config import EpisodeLimits
from pipeline.rollout.episode import GroupSlot, run_episode
from pipeline.testing import ScriptedPolicy

CFG = ModelConfig(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=128)
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def model() -> Any:
    return init_model(CFG, seed=3)


def server_for(model: Any, slots: int) -> PolicyServer:
    engine = DecodeEngine(model, slots, SamplingConfig(1.0, seed=4), chunk=8)
    return PolicyServer(engine, {TOK.eos, TOK.end_call}).start()


def member(i: int = 0, task: Task | None = None) -> GroupSlot:
    return GroupSlot("g", 4, i, task or Task("t", {"secret": 3}))


def test_trajectory_is_exactly_what_the_sampler_saw(model: Any) -> None:
    server = server_for(model, 1)
    env = make("guess", max_turns=3)
    t = asyncio.run(
        run_episode(env, member(), server, 0, TOK, EpisodeLimits(max_new_tokens=6), "p")
    )
    server.stop()
    text = TOK.decode(t.tokens.tolist(), specials=True)
    assert text.startswith("<bos><user>Guess my number from 1 to 8.<assistant>")
    roles = [turn.role for turn in t.turns]
    assert roles[0] == "user" and roles[1] == "assistant"
    # policy tokens are exactly the assistant turns after their opener token
    policy = np.flatnonzero(t.loss_mask)
    expected = [
        p for turn in t.turns if turn.role == "assistant" for p in range(turn.start + 1, turn.end)
    ]
    assert policy.tolist() == expected
    for turn in t.turns:
        if turn.role == "environment":
            obs = TOK.decode(t.tokens[turn.start : turn.end].tolist())
            assert obs in ("Higher.", "Lower.", "Say a number.")
    # behaviour log-probabilities are those of the model on the recorded sequence:
    # the cache held exactly these tokens
    full = np.asarray(token_logprobs(model, jnp.asarray([t.tokens.tolist()]))[0])
    np.testing.assert_allclose(t.logprobs[policy], full[policy], atol=1e-4)
    assert t.version_spans[0].version == 0
    TrajectoryCodec().encode(t)  # a valid record


def test_the_record_names_the_temperature_its_log_probabilities_were_taken_at(
    model: Any,
) -> None:
    for temperature, taken_at in ((0.7, 0.7), (0.0, 1.0)):  # greedy tokens: scored at 1
        engine = DecodeEngine(model, 1, SamplingConfig(temperature, seed=5), chunk=8)
        server = PolicyServer(engine, {TOK.eos, TOK.end_call}).start()
        env = make("guess", max_turns=2)
        t = asyncio.run(
            run_episode(env, member(), server, 0, TOK, EpisodeLimits(max_new_tokens=6), "p")
        )
        server.stop()
        assert float(t.metadata[META_TEMPERATURE]) == taken_at
        policy = np.flatnonzero(t.loss_mask)
        tokens = jnp.asarray([t.tokens.tolist()])
        full = np.asarray(token_logprobs(model, tokens, taken_at)[0])
        np.testing.assert_allclose(t.logprobs[policy], full[policy], atol=1e-4)


class Hanging(Environment):
    name = "hanging"

    def __init__(self, hang: bool) -> None:
        self.hang = hang

    def sample_task(self, rng: random.Random) -> Task:
        return Task("x")

    async def reset(self, task: Task) -> str:
        return "go"

    async def step(self, action: str) -> Step:
        if self.hang:
            await asyncio.Event().wait()
        return Step("done", 1.0, True)


class Failing(Hanging):
    name = "failing"

    async def step(self, action: str) -> Step:
        raise ConnectionError("sandbox died")


def test_a_hanging_episode_does_not_hold_up_the_others(model: Any) -> None:
    server = server_for(model, 4)
    limits = EpisodeLimits(max_new_tokens=4, step_timeout_s=4.0)

    async def main() -> tuple[list[Any], float, Any]:
        # warm up (compile) first, so that only environment time is measured
        await run_episode(Hanging(False), member(1), server, 1, TOK, limits, "p")
        start = time.monotonic()
        hanging = asyncio.create_task(
            run_episode(Hanging(True), member(0), server, 0, TOK, limits, "p")
        )
        others = [
            asyncio.create_task(run_episode(Hanging(False), member(i), server, i, TOK, limits, "p"))
            for i in (1, 2, 3)
        ]
        done = await asyncio.gather(*others)
        elapsed = time.monotonic() - start
        assert not hanging.done()
        return done, elapsed, await hanging

    done, elapsed, hung = asyncio.run(main())
    server.stop()
    assert [t.status for t in done] == ["ok"] * 3 and elapsed < 3.5
    assert hung.status == "timeout" and hung.reward == 0.0


def test_environment_failure_is_a_record_not_a_crash(model: Any) -> None:
    server = server_for(model, 1)
    t = asyncio.run(run_episode(Failing(False), member(), server, 0, TOK, EpisodeLimits(4), "p"))
    server.stop()
    assert t.status == "env_error"
    TrajectoryCodec().encode(t)


def test_tool_call_result_goes_back_as_an_observation() -> None:
    call = [TOK.call, *TOK.encode("calc 6*7"), TOK.end_call]
    answer = [*TOK.encode("42"), TOK.eos]
    policy = ScriptedPolicy([call, answer])
    env = make("calc")
    task = Task("calc-6*7+0", {"expression": "6*7+0", "answer": 42})
    t = asyncio.run(
        run_episode(
            env,
            member(task=task),
            policy,
            0,
            TOK,  # type: ignore[arg-type]
            EpisodeLimits(8),
            "p",
        )
    )
    assert t.status == "ok" and t.reward == 1.0
    tool_turn = next(turn for turn in t.turns if turn.role == "tool")
    assert tool_turn.tool_name == "calc"
    assert TOK.decode(t.tokens[tool_turn.start : tool_turn.end].tolist()) == "42"
    # the second feed is exactly the tool turn plus the assistant opener
    assert policy.fed[1] == [*TOK.turn("tool", "42"), TOK.special["<assistant>"]]
    assert TOK.decode(t.tokens.tolist(), specials=True).endswith("<assistant>42<eos>")


def test_a_checkpoints_chat_template_lays_out_the_episode(tmp_path: Any) -> None:
    """With a Hugging Face checkpoint's tokenizer, the episode's tokens are the chat
    template's rendering of the whole conversation, the tool call is the template's own
    format, and the policy tokens are exactly what the policy sampled."""
    from pipeline.policy.chat import ChatTokenizer
    from pipeline.policy.hf_init import init_checkpoint

    tok = ChatTokenizer.load(init_checkpoint(tmp_path / "qwen2", "qwen2"))
    (end,) = tok.encode("<|im_end|>")
    call_text = '<tool_call>\n{"name": "calc", "arguments": {"expression": "6*7"}}\n</tool_call>'
    call = [*tok.encode(call_text), end]
    answer = [*tok.encode("42"), end]
    policy = ScriptedPolicy([call, answer], tok)
    task = Task("calc-6*7+0", {"expression": "6*7+0", "answer": 42})
    t = asyncio.run(
        run_episode(make("calc"), member(task=task), policy, 0, tok, EpisodeLimits(8), "p")  # type: ignore[arg-type]
    )
    assert t.status == "ok" and t.reward == 1.0 and t.tokenizer_id == tok.id
    messages = [
        {"role": "user", "content": asyncio.run(make("calc").reset(task))},
        {"role": "assistant", "content": call_text},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "42"},
    ]
    # the template lists the environment's tools, as transformers' tools= does
    rendered = tok.encode(tok.render(messages, tools=make("calc").tools.describe()))
    assert t.tokens.tolist() == rendered[: len(t.tokens)]
    assert tok.decode(rendered[len(t.tokens) :], specials=True) == "\n"  # after the last turn
    assert next(turn for turn in t.turns if turn.role == "tool").tool_name == "calc"
    assert policy.fed[1] == [*tok.turn("tool", "42"), *tok.assistant_header]
    policy_tokens = t.tokens[np.flatnonzero(t.loss_mask)].tolist()
    assert policy_tokens == call + answer


def test_unknown_tool_is_reported_to_the_agent() -> None:
    policy = ScriptedPolicy(
        [[TOK.call, *TOK.encode("rm -rf"), TOK.end_call], [*TOK.encode("1"), TOK.eos]]
    )
    t = asyncio.run(
        run_episode(
            make("calc"),
            member(task=Task("c", {"expression": "1", "answer": 1})),
            policy,
            0,
            TOK,
            EpisodeLimits(8),
            "p",
        )
    )  # type: ignore[arg-type]
    tool_turn = next(turn for turn in t.turns if turn.role == "tool")
    assert "no tool named 'rm'" in TOK.decode(t.tokens[tool_turn.start : tool_turn.end].tolist())


def test_safe_arithmetic_evaluates_nothing_else() -> None:
    from connectors.builtin import safe_arithmetic

    assert safe_arithmetic("3*(4+5)-2") == 25
    for bad in ("__import__('os')", "2**99999", "a+1", "1/0", "1//0", "9" * 80):
        with pytest.raises(ValueError):
            safe_arithmetic(bad)


def test_a_swap_applied_while_idle_is_recorded_and_the_next_episode_samples_it(
    model: Any,
) -> None:
    import time

    from flax import nnx

    server = server_for(model, 1)
    server.swap(nnx.state(init_model(CFG, seed=9)), 7)
    deadline = time.monotonic() + 10
    while not server.swaps and time.monotonic() < deadline:
        time.sleep(0.01)
    # nothing was generating: the swap is recorded with no decode step after it
    assert [(v, first) for v, _, _, first in server.swaps] == [(7, None)]
    t = asyncio.run(
        run_episode(make("guess"), member(), server, 0, TOK, EpisodeLimits(max_new_tokens=4), "p")
    )
    server.stop()
    assert t.version_spans[0].version == 7


def test_spans_inside_an_episode_are_recorded_for_detailed_slots_only(model: Any) -> None:
    """Every episode records its own span with its environment and policy seconds; the
    spans inside it only where the tracer details the slot; the profile's environment
    share is the same from either account."""
    from pipeline.observe.profile import Telemetry, summarize
    from pipeline.observe.telemetry import NullTracer, Tracer, install

    t = install(Tracer("p", detail_every=2))
    server = server_for(model, 2)
    try:

        async def both() -> None:
            await asyncio.gather(
                *(
                    run_episode(make("guess", max_turns=3), member(i), server, i, TOK, LIM, "p")
                    for i in range(2)
                )
            )

        LIM = EpisodeLimits(max_new_tokens=6)
        asyncio.run(both())
    finally:
        server.stop()
        install(NullTracer())
    datum = t.take()
    assert datum is not None
    spans = [
        dict(zip(("name", "start_ns", "end_ns", "track", "attributes"), s, strict=True))
        for s in datum["spans"]
    ]
    episodes = [s for s in spans if s["name"] == "episode"]
    assert sorted(s["track"] for s in episodes) == ["slot-0", "slot-1"]
    inner = [s for s in spans if s["name"] in ("env_reset", "env_step", "policy_turn")]
    assert inner and {s["track"] for s in inner} == {"slot-0"}  # slot 1 is not detailed
    detailed = next(s for s in episodes if s["track"] == "slot-0")
    env_spans = sum(s["end_ns"] - s["start_ns"] for s in inner if s["name"] != "policy_turn") / 1e9
    # the episode's own account covers its environment spans (and the wait around them)
    assert env_spans <= float(detailed["attributes"]["env_s"]) <= env_spans + 0.05
    tel = Telemetry()
    tel.add({"process": "p", "host": "h", "pid": 1, "spans": [*spans, _produce()], "metrics": []})
    share = summarize(tel)["env_wait_share"]
    total_env = sum(float(s["attributes"]["env_s"]) for s in episodes)
    total = sum(s["end_ns"] - s["start_ns"] for s in episodes) / 1e9
    assert share == pytest.approx(total_env / total)
    # an attribute that is no number of seconds counts as none, never as NaN
    for bad in ("nan", "-1", "inf", "x"):
        tel = Telemetry()
        hostile = [{**e, "attributes": {**e["attributes"], "env_s": bad}} for e in episodes]
        tel.add(
            {"process": "p", "host": "h", "pid": 1, "spans": [*hostile, _produce()], "metrics": []}
        )
        share = summarize(tel)["env_wait_share"]
        assert 0 <= share <= 1


def _produce() -> dict[str, Any]:
    return {"name": "produce", "start_ns": 0, "end_ns": 1, "track": "kafka", "attributes": {}}


def test_a_tracer_details_at_least_every_slot() -> None:
    from pipeline.observe.telemetry import NullTracer, Tracer

    assert [Tracer("p", detail_every=3).detailed(i) for i in range(4)] == [True, False, False, True]
    assert not NullTracer().detailed(0)
    with pytest.raises(ValueError, match="detail_every"):
        Tracer("p", detail_every=0)


class Components(Environment):
    """Reports reward components as given (``info["rewards"]``), then ends."""

    name = "components"

    def __init__(self, given: Any, reward: float = 1.0) -> None:
        self.given, self.reward = given, reward

    def sample_task(self, rng: random.Random) -> Task:
        return Task("c")

    async def reset(self, task: Task) -> str:
        return "go"

    async def step(self, action: str) -> Step:
        return Step("", self.reward, True, {"rewards": self.given})


def test_reward_components_are_kept_only_when_finite_named_and_bounded() -> None:
    from pipeline.rollout.episode import MAX_COMPONENT_NAME, MAX_COMPONENTS

    def play(given: Any, reward: float = 1.0) -> dict[str, float]:
        t = asyncio.run(
            run_episode(
                Components(given, reward),
                member(),
                ScriptedPolicy([[*TOK.encode("x"), TOK.eos]]),  # type: ignore[arg-type]
                0,
                TOK,
                EpisodeLimits(max_new_tokens=4),
                "p",
            )
        )
        TrajectoryCodec().encode(t)  # always a valid record
        return dict(t.rewards)

    assert play({"correct": 1, "format": 0.25}) == {"correct": 1.0, "format": 0.25, "env": 1.0}
    hostile = {
        "nan": float("nan"),
        "inf": float("-inf"),
        "flag": True,
        "text": "1.0",
        "none": None,
        "env": 99.0,  # the reward's own name is not an environment's to set
        "": 1.0,
        "x" * (MAX_COMPONENT_NAME + 1): 1.0,
        7: 1.0,
        "kept": -2.5,
    }
    assert play(hostile) == {"kept": -2.5, "env": 1.0}
    assert play([1, 2]) == {"env": 1.0} and play("rewards") == {"env": 1.0}
    many = play({f"c{i}": float(i) for i in range(1000)})
    assert len(many) == MAX_COMPONENTS + 1 and many["c0"] == 0.0
    # an episode that fails reports no component (a reward past the bound: env_error)
    assert set(play({"kept": 1.0}, reward=1e300)) == {"env"}
