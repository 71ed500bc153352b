"""openenv:URL against a server made with openenv-core's own classes
(``tests/openenv_server.py``): whole episodes, and the ways a server answers badly."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connectors.base import SeedTask, close_shared, env_name, make
from pipeline.errors import InvalidConfigError
from tests.servers import free_port, serving

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serving(lambda port: ["-m", "tests.openenv_server", str(port)]) as port:
        yield f"http://127.0.0.1:{port}"


def episode(url: str, task: SeedTask, policy: Any, **options: Any) -> tuple[str, list[Any]]:
    """One episode: ``policy(observation)`` gives each action; (prompt, steps)."""

    async def go() -> tuple[str, list[Any]]:
        env = make(f"openenv:{url}", **options)
        try:
            prompt = await env.reset(task)
            steps, seen = [], prompt
            for _ in range(10):
                step = await asyncio.wait_for(env.step(policy(seen)), 10)
                steps.append(step)
                seen = step.observation
                if step.done:
                    break
            return prompt, steps
        finally:
            await env.close()
            await close_shared()

    return asyncio.run(go())


def test_an_openenv_game_is_played_over_its_websocket_session(server: str) -> None:
    env = make(f"openenv:{server}")
    assert env.name == env_name(f"openenv:{server}")
    assert all(c.isalnum() or c in "._-" for c in env.name)
    task = env.sample_task(random.Random(4))
    lo, hi = 1, 16
    guesses: list[int] = []

    def bisect(said: str) -> str:
        nonlocal lo, hi
        if guesses and said == "Higher.":
            lo = guesses[-1] + 1
        elif guesses and said == "Lower.":
            hi = guesses[-1] - 1
        guesses.append((lo + hi) // 2)
        return str(guesses[-1])

    prompt, steps = episode(server, task, bisect)
    assert prompt == "Guess my number from 1 to 16."
    assert steps[-1].done and steps[-1].reward == 1.0 and steps[-1].observation == "Right."
    assert len(steps) <= 5 and all(s.reward == 0.0 for s in steps[:-1])
    # the task's seed is the server's: the same seed, the same game
    lo, hi, first = 1, 16, list(guesses)
    guesses.clear()
    assert [s.observation for s in episode(server, task, bisect)[1]] == [
        s.observation for s in steps
    ]
    assert guesses == first


def test_a_server_that_answers_badly_ends_the_episode_with_a_reason(server: str) -> None:
    from connectors import protocol

    task = SeedTask("seed-1", {}, 1)
    # a message over the bound closes the session
    with pytest.raises(protocol.ConnectorError, match="session ended"):
        episode(server, task, lambda _: "99", max_message_bytes=100_000)
    # a step that hangs is cut by the episode's timeout
    with pytest.raises(TimeoutError):
        episode(server, task, lambda _: "77")
    # the server's own refusal of a bad action: an error message
    with pytest.raises(protocol.RemoteError):
        episode(server, task, lambda _: "5", action_field="not_a_field")
    # a server that is not there
    nowhere = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(protocol.ConnectorError, match="connection"):
        episode(nowhere, task, lambda _: "5")


def test_openenv_options_are_checked_before_any_episode() -> None:
    for url, options, why in (
        ("ftp://x", {}, "not an http"),
        ("http://", {}, "not an http"),
        ("http://h:1", {"call_timeout_s": 0}, "call_timeout_s"),
        ("http://h:1", {"max_message_bytes": 10}, "max_message_bytes"),
        ("http://h:1", {"bogus": 1}, "bad options"),
    ):
        with pytest.raises(InvalidConfigError, match=why):
            make(f"openenv:{url}", **options)


def test_an_action_schema_without_one_text_field_needs_the_option() -> None:
    from connectors.openenv import _action_field

    good = {"action": {"properties": {"m": {"type": "string"}}, "required": ["m"]}}
    assert _action_field(good, "u") == "m"
    for schema in (
        {},
        {"action": []},
        {"action": {"properties": {"m": "x"}, "required": ["m"]}},
        {"action": {"properties": {"m": {"type": "integer"}}, "required": ["m"]}},
        {
            "action": {
                "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                "required": ["a", "b"],
            }
        },
    ):
        with pytest.raises(InvalidConfigError, match="action_field"):
            _action_field(schema, "u")


@pytest.mark.parametrize(
    "reply, why",
    [
        ("not json", "not JSON"),
        ('{"type": "observation", "data": {"observation": {}, "reward": NaN}}', "not JSON"),
        ('{"type": "observation", "data": {"observation": {}, "reward": 1e999}}', "reward"),
        ('{"type": "observation", "data": {"observation": {}, "reward": "1"}}', "reward"),
        ('{"type": "observation", "data": {"observation": {}, "done": "yes"}}', "done"),
        ('{"type": "observation", "data": {"observation": []}}', "no observation"),
        ('{"type": "state", "data": {}}', "where observation was due"),
        ('{"type": "error", "data": {"message": "no such thing"}}', "no such thing"),
        ("[1, 2]", "not a JSON object"),
    ],
)
def test_whatever_bytes_a_server_sends_the_episode_ends_with_a_reason(reply: str, why: str) -> None:
    """A server that speaks OpenEnv's protocol until its answer to the first step (an
    aiohttp server scripted with the bytes to send: the hostile side of the boundary)."""
    from aiohttp import web

    from connectors import protocol

    async def ws(request: web.Request) -> web.WebSocketResponse:
        sock = web.WebSocketResponse()
        await sock.prepare(request)
        async for msg in sock:
            kind = json.loads(msg.data)["type"]
            if kind == "reset":
                ok = {"observation": {"message": "go"}, "reward": None, "done": False}
                await sock.send_str(json.dumps({"type": "observation", "data": ok}))
            elif kind == "step":
                await sock.send_str(reply)
            else:
                break
        return sock

    async def go() -> None:
        app = web.Application()
        schema = {"action": {"properties": {"m": {"type": "string"}}, "required": ["m"]}}

        async def health(_: web.Request) -> web.Response:
            return web.json_response({"status": "healthy"})

        async def described(_: web.Request) -> web.Response:
            return web.json_response(schema)

        app.router.add_get("/health", health)
        app.router.add_get("/schema", described)
        app.router.add_get("/ws", ws)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        env = make(f"openenv:http://127.0.0.1:{port}")
        try:
            assert await env.reset(SeedTask("s", {}, 1)) == "go"
            with pytest.raises(protocol.ConnectorError, match=why):
                await asyncio.wait_for(env.step("5"), 10)
        finally:
            await env.close()
            await close_shared()
            await runner.cleanup()

    asyncio.run(go())
