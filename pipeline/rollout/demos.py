"""Demonstrations for ``rlstream sft``: an environment's scripted solver
(:meth:`connectors.base.Environment.demonstrate`) played through the environment itself,
written as JSONL conversations (messages in the usual chat format, tool calls included,
and the environment's tools). Only demonstrations the environment rewards as solved are
kept: a solver that fails writes nothing that would teach a wrong answer.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from connectors.base import Environment, Task, make
from pipeline.errors import InvalidConfigError
from pipeline.policy.chat import argument_text
from pipeline.records.trajectory import succeeded


async def demonstration(env: Environment, task: Task) -> dict[str, Any] | None:
    """The solver's conversation of ``task`` (``{"messages", "tools"}``), or None when the
    environment does not reward it as solved."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": await env.reset(task)}]

    async def call(name: str, arguments: dict[str, Any]) -> str:
        fn = {"name": name, "arguments": arguments}
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": fn}],
            }
        )
        result = await env.call_tool(name, argument_text(arguments))
        messages.append({"role": "tool", "content": result})
        return result

    try:
        answer = await env.demonstrate(task, call)
        if answer is None:
            raise InvalidConfigError(
                f"environment {env.name!r} has no scripted solver (demonstrate)"
            )
        messages.append({"role": "assistant", "content": answer})
        step = await env.step(answer)
    finally:
        await env.close()
    rewards = step.info.get("rewards")  # judged as an episode is (its reward components)
    if not step.done or not succeeded(step.reward, rewards if isinstance(rewards, dict) else {}):
        return None
    tools = env.tools.describe() if env.tools is not None else []
    return {"messages": messages, "tools": [{"type": "function", "function": t} for t in tools]}


def write_demonstrations(
    env_name: str,
    env_options: dict[str, Any],
    episodes: int,
    out: Path,
    seed: int = 0,
    progress: Callable[[str], None] = lambda s: None,
) -> dict[str, int]:
    """``episodes`` demonstrations of tasks drawn from ``seed`` (the producers' task
    stream, not the held-out one) into the JSONL file ``out``; returns how many were
    written and how many the environment did not reward."""
    if episodes < 1:
        raise InvalidConfigError(f"episodes must be at least 1, not {episodes}")
    rng = random.Random(seed)
    written = failed = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    with tmp.open("w") as f:
        while written < episodes:
            if failed > episodes:
                raise InvalidConfigError(
                    f"environment {env_name!r}'s solver failed {failed} tasks for {written} "
                    "solved: its demonstrations would teach little"
                )
            env = make(env_name, **env_options)
            demo = asyncio.run(demonstration(env, env.sample_task(rng)))
            if demo is None:
                failed += 1
                continue
            f.write(json.dumps(demo) + "\n")
            written += 1
            if written % 100 == 0 or written == episodes:
                progress(f"demonstrations: {written}/{episodes}")
    tmp.replace(out)
    return {"written": written, "unsolved": failed}
