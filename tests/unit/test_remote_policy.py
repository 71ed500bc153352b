"""The answers of an inference server are a boundary: whatever comes back, a turn either
holds the server's token ids, finite log-probabilities and confirmed version, or ends its
episode with a reason (tests/integration/test_remote_policy.py runs the real llama.cpp
server)."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
from aiohttp import web

from pipeline.errors import InvalidConfigError
from pipeline.policy.config import ModelConfig, SamplingConfig
from pipeline.policy.remote import RemotePolicy, RemotePolicyError, server_url

CFG = ModelConfig(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=64, vocab_size=100)


def policy(url: str = "http://127.0.0.1:1", **kw: Any) -> RemotePolicy:
    return RemotePolicy(url, CFG, SamplingConfig(), {99}, **kw)


def llama(ids: list[int], logps: list[float], model: str | None = None) -> dict[str, Any]:
    return {
        "model": model,
        "choices": [
            {
                "logprobs": {
                    "content": [{"id": i, "logprob": lp} for i, lp in zip(ids, logps, strict=True)]
                }
            }
        ],
    }


def test_server_addresses_are_checked() -> None:
    assert server_url("local") is None
    assert server_url("openai:http://127.0.0.1:8080/v1/") == "http://127.0.0.1:8080"
    assert server_url("openai:https://h.example:443/base") == "https://h.example:443/base"
    for bad in ("openai:", "openai:127.0.0.1:8080", "openai:ftp://h", "openai:http://a b", "vllm"):
        with pytest.raises(InvalidConfigError):
            server_url(bad)


def test_both_answer_formats_give_ids_and_log_probabilities() -> None:
    p = policy()
    assert p._parse(llama([5, 7], [-0.5, -1.25]), 4, None) == ([5, 7], [-0.5, -1.25], None)
    with_probs = {"choices": [{"logprobs": {"content": [{"id": 3, "prob": 0.5}]}}]}
    ids, logps, _ = p._parse(with_probs, 4, None)
    assert ids == [3] and logps == [pytest.approx(math.log(0.5))]
    vllm = {
        "choices": [
            {"logprobs": {"tokens": ["token_id:4", "token_id:9"], "token_logprobs": [-1.0, -2.0]}}
        ]
    }
    assert p._parse(vllm, 4, None) == ([4, 9], [-1.0, -2.0], None)
    # a rounding error just above 0 is 0, the model named gives the version
    assert p._parse(llama([1], [1e-7], "ns-v12"), 4, "ns-v12") == ([1], [0.0], 12)


@pytest.mark.parametrize(
    "answer, reason",
    [
        ({}, "no choices"),
        ({"choices": []}, "no choices"),
        ({"choices": [{"text": "hi", "logprobs": None}]}, "no token ids"),
        ({"choices": [{"logprobs": {"tokens": ["hi"], "token_logprobs": [-1.0]}}]}, "not an id"),
        (llama([100], [-1.0]), "not an id"),
        (llama([-1], [-1.0]), "not an id"),
        (llama([True], [-1.0]), "not an id"),  # type: ignore[list-item]
        (llama([1], [float("nan")]), "log-probability"),
        (llama([1], [float("inf")]), "log-probability"),
        (llama([1], [-float("inf")]), "log-probability"),
        (llama([1], [0.5]), "log-probability"),
        (llama([1], ["x"]), "log-probability"),  # type: ignore[list-item]
        ({"choices": [{"logprobs": {"content": [{"id": 1, "prob": 0.0}]}}]}, "log-probability"),
        ({"choices": [{"logprobs": {"content": [{"id": 1, "prob": 2.0}]}}]}, "log-probability"),
        ({"choices": [{"logprobs": {"content": [7]}}]}, "non-object"),
        ({"choices": [{"logprobs": {"tokens": ["token_id:1"], "token_logprobs": []}}]}, "1 tokens"),
        (llama([1, 2, 3, 4, 5], [-1.0] * 5), "at most 4"),
    ],
)
def test_answers_that_cannot_be_recorded_are_refused_with_a_reason(
    answer: Any, reason: str
) -> None:
    with pytest.raises(RemotePolicyError, match=reason):
        policy()._parse(answer, 4, None)


def test_an_answer_from_another_model_than_asked_is_refused() -> None:
    with pytest.raises(RemotePolicyError, match="served by model 'ns-v2', asked for 'ns-v3'"):
        policy()._parse(llama([1], [-1.0], "ns-v2"), 4, "ns-v3")


def serve(handler: Any) -> Any:
    """Run ``handler`` as POST /v1/completions on a free port; returns (runner, url)."""

    async def start() -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return runner, f"http://127.0.0.1:{port}"

    return start()


def turn(handler: Any, **kw: Any) -> Any:
    async def go() -> Any:
        runner, url = await serve(handler)
        p = policy(url, **kw)
        try:
            return await p.generate(0, [1, 2, 3], 4, reset=True, stream=7), p
        finally:
            await p.aclose()
            await runner.cleanup()

    return asyncio.run(go())


def test_a_turn_is_cut_at_a_stop_token_and_the_conversation_keeps_what_was_recorded() -> None:
    seen: list[dict[str, Any]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response(llama([10, 99, 11], [-0.1, -0.2, -0.3]))

    result, p = turn(handler)
    assert (result.tokens, result.logprobs, result.versions, result.stopped) == (
        [10, 99],
        [-0.1, -0.2],
        [0, 0],
        99,
    )
    assert p.room(0) == CFG.max_len - 5  # prompt + the two recorded tokens
    body = seen[0]
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 4 and body["logprobs"] == 1
    assert "model" not in body  # no router: the server's one model


@pytest.mark.parametrize(
    "respond, reason",
    [
        (lambda: web.Response(status=500, text="boom"), "server error: 500 boom"),
        (lambda: web.Response(text="not json"), "bad answer: not JSON"),
        (lambda: web.json_response({"choices": [{"logprobs": None}]}), "no token ids"),
    ],
)
def test_a_failed_turn_raises_its_reason_and_is_counted(respond: Any, reason: str) -> None:
    async def handler(request: web.Request) -> web.Response:
        return respond()  # type: ignore[no-any-return]

    async def go() -> RemotePolicy:
        runner, url = await serve(handler)
        p = policy(url)
        try:
            with pytest.raises(RemotePolicyError, match=reason):
                await p.generate(0, [1], 4, reset=True)
            return p
        finally:
            await p.aclose()
            await runner.cleanup()

    p = asyncio.run(go())
    assert sum(p.failures.values()) == 1


def test_a_server_that_drops_the_connection_ends_the_turn_at_once() -> None:
    async def handler(request: web.Request) -> web.Response:
        assert request.transport is not None
        request.transport.close()
        await asyncio.sleep(5)
        return web.Response()

    async def go() -> float:
        runner, url = await serve(handler)
        p = policy(url, wait_s=30.0)
        t0 = asyncio.get_running_loop().time()
        try:
            with pytest.raises(RemotePolicyError, match="turn dropped"):
                await p.generate(0, [1], 4, reset=True)
            return asyncio.get_running_loop().time() - t0
        finally:
            await p.aclose()
            await runner.cleanup()

    assert asyncio.run(go()) < 5


def test_an_unreachable_server_is_waited_for_then_refused() -> None:
    async def go() -> float:
        p = policy("http://127.0.0.1:9", wait_s=0.5)  # discard port: nothing listens
        t0 = asyncio.get_running_loop().time()
        try:
            with pytest.raises(RemotePolicyError, match=r"unreachable.*did not answer for 0\.5s"):
                await p.generate(0, [1], 4, reset=True)
            return asyncio.get_running_loop().time() - t0
        finally:
            await p.aclose()

    assert 0.4 < asyncio.run(go()) < 5


def test_a_conversation_past_the_context_samples_nothing() -> None:
    async def go() -> Any:
        p = policy()
        return await p.generate(0, list(range(CFG.max_len + 1)), 4, reset=True)

    assert asyncio.run(go()).tokens == []


def test_weights_need_a_models_folder() -> None:
    with pytest.raises(RemotePolicyError, match="no models folder"):
        policy().swap({}, 3)


def test_requests_carry_a_seed_of_the_conversation_and_position() -> None:
    p = policy()
    a = p._request([1, 2], 4, None, 5)
    b = p._request([1, 2], 4, None, 5)
    c = p._request([1, 2, 3], 4, None, 5)
    d = p._request([1, 2], 4, None, 6)
    assert a["seed"] == b["seed"] and len({a["seed"], c["seed"], d["seed"]}) == 3
    assert json.dumps(a)  # plain JSON


def test_a_producer_with_a_server_must_say_how_weights_reach_it(tmp_path: Any) -> None:
    from pipeline.rollout.config import ProducerConfig

    url = "openai:http://127.0.0.1:8080"
    with pytest.raises(InvalidConfigError, match="--policy-models-dir"):
        ProducerConfig(policy=url)  # announced weights are taken by default
    assert ProducerConfig(policy=url, checkpoint_roots=()).policy_models_dir is None
    assert ProducerConfig(policy=url, policy_models_dir=tmp_path).policy == url
    with pytest.raises(InvalidConfigError, match="is not a folder"):
        ProducerConfig(policy=url, policy_models_dir=tmp_path / "missing")
    with pytest.raises(InvalidConfigError, match="for --policy openai:URL"):
        ProducerConfig(policy_models_dir=tmp_path)
    with pytest.raises(InvalidConfigError, match="policy_wait_s"):
        ProducerConfig(policy=url, checkpoint_roots=(), policy_wait_s=-1)
