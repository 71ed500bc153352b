"""Tools, protocol messages and the session host, in process."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from connectors import protocol, stats
from connectors.base import make
from connectors.serve import HostError, SessionHost
from connectors.tools import Tool, ToolRegistry
from pipeline.errors import InvalidConfigError

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer", "maximum": 100}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


async def add(a: int, b: int) -> int:
    return a + b


async def slow(text: str) -> str:
    await asyncio.sleep(10)
    return text


async def broken(text: str) -> str:
    raise RuntimeError("disk full")


async def loud(text: str) -> str:
    return text * 1000


def registry() -> ToolRegistry:
    one = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    return ToolRegistry(
        [
            Tool("add", "adds two integers", ADD, add),
            Tool("slow", "never in time", one, slow, timeout_s=0.05),
            Tool("broken", "fails", one, broken),
            Tool("loud", "talks a lot", one, loud, max_result_chars=20),
        ]
    )


def test_tool_calls_are_parsed_validated_and_answered() -> None:
    reg = registry()
    stats.reset()
    cases = {
        ("add", '{"a": 2, "b": 3}'): "5",
        ("add", '{"a": 2}'): "error: arguments: 'b' is a required property",
        ("add", '{"a": 2, "b": 300}'): "error: b: 300 is greater than the maximum of 100",
        ("add", '{"a": 2, "b": 3, "c": 1}'): "error: arguments: Additional properties are "
        "not allowed ('c' was unexpected)",
        ("add", "{not json"): "error: arguments are not valid JSON: Expecting property name "
        "enclosed in double quotes",
        ("add", "[1, 2]"): "error: arguments must be a JSON object",
        ("add", "2 3"): "error: arguments must be a JSON object",  # two arguments: JSON only
        ("slow", "x"): "error: timed out after 0.05 s",
        ("broken", "x"): "error: RuntimeError: disk full",
        ("loud", "ab"): "abababababababababab [truncated]",
        ("nope", "x"): "error: no tool named 'nope'",
    }

    async def main() -> dict[tuple[str, str], str]:
        return {k: (await reg.call(*k)).text for k in cases}

    assert asyncio.run(main()) == cases
    c = stats.snapshot()
    assert c["tool/add/ok"] == 1 and c["tool/add/bad_arguments"] == 6
    assert c["tool/slow/timeout"] == 1 and c["tool/broken/failed"] == 1
    assert c["tool/nope/unknown_tool"] == 1
    assert [t["name"] for t in reg.describe()] == ["add", "slow", "broken", "loud"]
    assert reg.describe()[0]["parameters"] == ADD


def test_bad_tool_definitions_are_refused() -> None:
    with pytest.raises(InvalidConfigError, match="bad JSON Schema"):
        ToolRegistry([Tool("t", "", {"type": "object", "properties": 3}, add)])
    with pytest.raises(InvalidConfigError, match="object schema"):
        ToolRegistry([Tool("t", "", {"type": "string"}, add)])
    with pytest.raises(InvalidConfigError, match="one word"):
        ToolRegistry([Tool("two words", "", ADD, add)])
    with pytest.raises(InvalidConfigError, match="twice"):
        ToolRegistry([Tool("t", "", ADD, add), Tool("t", "", ADD, add)])


def test_messages_are_bounded_and_checked() -> None:
    with pytest.raises(protocol.ConnectorError) as e:
        protocol.decode(b'{"version": 1, "x": "' + b"a" * 100 + b'"}', max_bytes=64)
    assert e.value.reason == "oversized"
    for raw in (b"\xff\xfe", b"[1]", b'{"version": 1, "reward": NaN}', b"[" * 100_000, b"{"):
        with pytest.raises(protocol.ConnectorError) as e:
            protocol.decode(raw)
        assert e.value.reason == "malformed", raw[:20]
    with pytest.raises(protocol.ConnectorError) as e:
        protocol.decode(b'{"version": 2}')
    assert e.value.reason == "version"
    good = {"version": 1, "observation": "hi", "reward": 1, "done": True, "info": {}}
    assert protocol.step_of(good).reward == 1.0
    for bad in (
        {"reward": "1"},
        {"reward": math.inf},
        {"done": 1},
        {"observation": 3},
        {"info": []},
        {"reward": True},
    ):
        with pytest.raises(protocol.ConnectorError):
            protocol.step_of({**good, **bad})
    with pytest.raises(protocol.ConnectorError, match="oversized"):
        protocol.step_of({**good, "observation": "x" * (protocol.MAX_TEXT_CHARS + 1)})
    assert protocol.plain({"a": (1, 2.5, float("nan")), 3: object}) == {
        "a": [1, 2.5, None],
        "3": repr(object),
    }


def test_every_call_is_safe_to_repeat() -> None:
    host = SessionHost("guess", {"max_turns": 2}, max_sessions=2)
    reset = {"version": 1, "task": {"task_id": "t", "params": {"secret": 5}}}

    async def main() -> None:
        first = await host.handle("reset", "s1", reset)
        assert await host.handle("reset", "s1", reset) == first  # a repeated reset
        with pytest.raises(HostError) as e:
            await host.handle("reset", "s1", {"version": 1, "seed": 3})
        assert e.value.status == 409
        one = await host.handle("step", "s1", {"version": 1, "seq": 1, "action": "1"})
        assert one["done"] is False and one["observation"] == "Higher."
        # a repeat answers what the first did and does not take a second turn ...
        assert await host.handle("step", "s1", {"version": 1, "seq": 1, "action": "1"}) == one
        # ... so the next step is the second (and last) turn
        two = await host.handle("step", "s1", {"version": 1, "seq": 2, "action": "1"})
        assert two["done"] is True
        with pytest.raises(HostError) as e:
            await host.handle("step", "s1", {"version": 1, "seq": 5, "action": "1"})
        assert e.value.code == "conflict"
        with pytest.raises(HostError) as e:
            await host.handle("reset", "s1", reset)  # reset after stepping: a new session id
        assert e.value.status == 409
        with pytest.raises(HostError) as e:
            await host.handle("tool", "s1", {"version": 1, "seq": 3, "name": "x", "arguments": ""})
        assert e.value.code == "no_such_tool"
        # seeds make tasks on the server side
        seeded = await host.handle("reset", "s2", {"version": 1, "seed": 11})
        assert seeded["task_id"].startswith("guess-1-8-")
        with pytest.raises(HostError) as e:
            await host.handle("reset", "s3", reset)
        assert (e.value.status, e.value.code) == (503, "overloaded")
        assert (await host.close("s1"))["closed"] is True
        assert (await host.close("s1"))["closed"] is False  # closing twice is fine
        with pytest.raises(HostError) as e:
            await host.handle("step", "s1", {"version": 1, "seq": 3, "action": "1"})
        assert e.value.code == "no_session"
        for bad in ({"version": 1, "seq": "1", "action": "1"}, {"version": 1, "seq": 1}):
            with pytest.raises(HostError) as e:
                await host.handle("step", "s2", bad)
            assert e.value.status == 400

    asyncio.run(main())


def test_idle_sessions_expire() -> None:
    host = SessionHost("guess", max_sessions=1, session_ttl_s=0.05)

    async def main() -> None:
        await host.handle("reset", "a", {"version": 1, "seed": 1})
        await asyncio.sleep(0.1)
        await host.handle("reset", "b", {"version": 1, "seed": 2})  # "a" made room
        assert list(host.sessions) == ["b"]

    asyncio.run(main())


def test_environment_failures_are_the_sessions_answer() -> None:
    class Exploding(Exception):
        pass

    host = SessionHost("guess", call_timeout_s=0.05)

    async def main() -> None:
        await host.handle("reset", "s", {"version": 1, "seed": 1})
        env: Any = host.sessions["s"].env

        async def explode(action: str) -> Any:
            raise Exploding("sandbox gone")

        env.step = explode
        with pytest.raises(HostError) as e:
            await host.handle("step", "s", {"version": 1, "seq": 1, "action": "1"})
        assert (e.value.status, e.value.code) == (500, "env_error")

        async def hang(action: str) -> Any:
            await asyncio.Event().wait()

        await host.handle("reset", "t", {"version": 1, "seed": 1})
        host.sessions["t"].env.step = hang  # type: ignore[method-assign]
        with pytest.raises(HostError) as e:
            await host.handle("step", "t", {"version": 1, "seq": 1, "action": "1"})
        assert (e.value.status, e.value.code) == (504, "env_timeout")

    asyncio.run(main())


def test_connector_options_are_checked() -> None:
    with pytest.raises(InvalidConfigError, match="not http"):
        make("http", url="ftp://x")
    with pytest.raises(InvalidConfigError, match="needs a command"):
        make("process", command="")
    with pytest.raises(InvalidConfigError, match="bad options"):
        make("http", url="http://127.0.0.1:1", bogus=1)
    assert make("http", url="http://127.0.0.1:1", name="guess").name == "guess"
