"""MCP servers' tools in episodes: servers made with the ``mcp`` SDK's own server class
(``tests/mcp_server.py``), over stdio and streamable HTTP; the ways a server fails."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connectors.base import Task, WithTools, close_shared, make, renew, shared
from connectors.mcp import McpServer
from connectors.tools import ToolServerError
from pipeline.errors import InvalidConfigError
from pipeline.policy.tokenizer import ByteTokenizer
from pipeline.rollout.config import EpisodeLimits
from pipeline.rollout.episode import GroupSlot, run_episode
from pipeline.testing import ScriptedPolicy
from tests.servers import serving

ROOT = Path(__file__).resolve().parents[2]
STDIO = f"mcp:{sys.executable} -m tests.mcp_server"
TOK = ByteTokenizer()
TASK = Task("calc-6*7+0", {"expression": "6*7+0", "answer": 42})


def call(text: str) -> list[int]:
    return [TOK.call, *TOK.encode(text), TOK.end_call]


def answer(text: str) -> list[int]:
    return [*TOK.encode(text), TOK.eos]


def play(tools: str, turns: list[list[int]], **server: Any) -> list[Any]:
    """Episodes of ``calc`` with ``tools``'s tools, one after another in one event loop
    (one connection), each turn list an episode's script."""

    async def go() -> list[Any]:
        out = []
        try:
            for i, script in enumerate(turns):
                env = make("calc", tools=(tools,))
                if server:  # a server with other bounds, in place of the default one
                    mine = shared(("mcp", tools), lambda: McpServer(tools, **server))
                    if mine.gone:
                        await mine.aclose()
                        renew(("mcp", tools), lambda: McpServer(tools, **server))
                out.append(
                    await run_episode(
                        env,
                        GroupSlot(f"g{i}", 1, 0, TASK),
                        ScriptedPolicy(script),  # type: ignore[arg-type]
                        0,
                        TOK,
                        EpisodeLimits(8, step_timeout_s=30),
                        "p",
                    )
                )
        finally:
            await close_shared()
        return out

    return asyncio.run(go())


def tool_text(t: Any) -> str:
    turn = next(turn for turn in t.turns if turn.role == "tool")
    return TOK.decode(t.tokens[turn.start : turn.end].tolist())


def test_env_tools_lists_what_the_server_declares() -> None:
    from mcp import Client

    from tests.mcp_server import server

    async def declared() -> dict[str, Any]:
        async with Client(server) as client:  # the SDK's own in-process view
            return {t.name: t.input_schema for t in (await client.list_tools()).tools}

    reference = asyncio.run(declared())
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "env", "tools", "--tools", STDIO, "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    listed = json.loads(proc.stdout.strip().splitlines()[-1])["tools"]
    assert {t["name"]: t["parameters"] for t in listed} == reference
    assert all(t["server"] == STDIO and t["description"] for t in listed)


def test_an_episode_calls_the_servers_tools_and_the_agent_reads_their_errors() -> None:
    ok, failed, bad_args, own = play(
        STDIO,
        [
            [call('add {"a": 2, "b": 40}'), answer("42")],
            [call('fail {"reason": "nope"}'), answer("42")],
            [call('add {"a": "x"}'), answer("42")],
            [call("calc 6*7"), answer("42")],  # the environment's own tool still answers
        ],
    )
    assert ok.status == "ok" and ok.reward == 1.0 and tool_text(ok) == "42"
    assert next(t for t in ok.turns if t.role == "tool").tool_name == "add"
    assert failed.status == "ok" and tool_text(failed).startswith("error: ")
    # checked against the server's schema before it is sent
    assert bad_args.status == "ok" and "error: " in tool_text(bad_args)
    assert "'b' is a required property" in tool_text(bad_args)
    assert own.status == "ok" and tool_text(own) == "42"


def test_a_server_that_dies_hangs_or_floods_ends_the_episode_never_the_producer() -> None:
    died, after, hung, flooded, long_ok = play(
        STDIO,
        [
            [call("die {}"), answer("42")],
            [call('add {"a": 1, "b": 41}'), answer("42")],  # a new connection
            [call('hang {"seconds": 60}'), answer("42")],
            [call('flood {"chars": 300000}'), answer("42")],
            [call('flood {"chars": 5000}'), answer("42")],
        ],
        call_timeout_s=2.0,
        max_answer_chars=100_000,
        max_result_chars=100,
    )
    assert died.status == "env_error"
    assert after.status == "ok" and tool_text(after) == "42"
    assert hung.status == "env_error" and flooded.status == "env_error"
    # a long answer within the bound is cut for the model
    assert long_ok.status == "ok" and tool_text(long_ok) == "x" * 100 + " [truncated]"


def test_servers_that_never_speak_mcp_are_refused_with_a_reason() -> None:
    async def connect(spec: str, **kw: Any) -> str:
        server = McpServer(spec, **kw)
        try:
            with pytest.raises(ToolServerError) as e:
                await server.connect()
            return str(e.value)
        finally:
            await server.aclose()

    start = time.monotonic()
    assert "no answer" in asyncio.run(connect("mcp:sleep 60", connect_timeout_s=1.5))
    assert "no answer" in asyncio.run(connect("mcp:yes", connect_timeout_s=1.5))  # a flood
    assert time.monotonic() - start < 30
    assert "Connection closed" in asyncio.run(connect("mcp:false"))
    assert "No such file" in asyncio.run(connect("mcp:no-such-program-rlstream"))
    for spec in ("mcp:", "mcp:   ", "nonsense", "mcp:'unclosed"):
        with pytest.raises(InvalidConfigError):
            make("calc", tools=(spec,))
    # an episode whose server cannot be reached is an environment error, with the reason
    (t,) = play("mcp:false", [[answer("42")]])
    assert t.status == "env_error"


@pytest.fixture
def http_server() -> Iterator[str]:
    with serving(lambda port: ["-m", "tests.mcp_server", "http", str(port)]) as port:
        yield f"mcp:http://127.0.0.1:{port}/mcp"


def test_a_server_over_streamable_http(http_server: str) -> None:
    (ok,) = play(http_server, [[call('shout {"text": "kafka"}'), answer("42")]])
    assert ok.status == "ok" and tool_text(ok) == "KAFKA"


def test_tools_reach_the_config_of_every_command() -> None:
    from pipeline.launch.config import RunConfig
    from pipeline.rollout.config import EvalConfig, ProducerConfig

    cfg = ProducerConfig(tools=(STDIO,))
    assert cfg.env_kwargs["tools"] == (STDIO,)
    assert isinstance(make(cfg.env, **cfg.env_kwargs), WithTools)
    assert "tools" not in ProducerConfig().env_kwargs
    run = RunConfig(tools=(STDIO,))
    assert run.producer(0, "ns", Path("r")).tools == (STDIO,)
    for cls in (ProducerConfig, EvalConfig, RunConfig):
        with pytest.raises(InvalidConfigError, match="mcp:COMMAND"):
            cls(tools=("http://not-named-mcp",))
