"""Demonstrations for ``rlstream sft``: an environment's scripted solver
(:meth:`connectors.base.Environment.demonstrate`) played through the environment itself,
written as JSONL conversations (messages in the usual chat format, tool calls included,
and the environment's tools). Only demonstrations the environment rewards as solved are
kept (a solver that fails writes nothing that would teach a wrong answer), unless
``keep_unsolved`` asks for transcripts as they are (a solver that, like the people whose
transcripts a data set holds, is sometimes wrong: calc's ``mental_share``).
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

#: tasks of demonstrations come from this seed plus theirs: a stream neither producers
#: (a run's seed + 1 + i) nor held-out evaluation (HELD_OUT_SEED + seed) draw from, so RL
#: never trains on the tasks SFT saw answered
DEMONSTRATION_SEED = 2_000_003


async def demonstration(env: Environment, task: Task) -> tuple[dict[str, Any], bool]:
    """The solver's conversation of ``task`` (``{"messages", "tools"}``) and whether the
    environment rewards it as solved."""
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
    solved = step.done and succeeded(step.reward, rewards if isinstance(rewards, dict) else {})
    tools = env.tools.describe() if env.tools is not None else []
    demo = {"messages": messages, "tools": [{"type": "function", "function": t} for t in tools]}
    return demo, solved


def write_demonstrations(
    env_name: str,
    env_options: dict[str, Any],
    episodes: int,
    out: Path,
    seed: int = 0,
    progress: Callable[[str], None] = lambda s: None,
    keep_unsolved: bool = False,
) -> dict[str, int]:
    """``episodes`` demonstrations of tasks drawn from ``seed`` (a stream of their own,
    :data:`DEMONSTRATION_SEED`) into the JSONL file ``out``; returns how many were
    written and how many the environment did not reward (left out, or with
    ``keep_unsolved`` written all the same)."""
    if episodes < 1:
        raise InvalidConfigError(f"episodes must be at least 1, not {episodes}")
    rng = random.Random(DEMONSTRATION_SEED + seed)
    written = failed = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    with tmp.open("w") as f:
        while written < episodes:
            if failed > episodes and not keep_unsolved:
                raise InvalidConfigError(
                    f"environment {env_name!r}'s solver failed {failed} tasks for {written} "
                    "solved: its demonstrations would teach little"
                )
            env = make(env_name, **env_options)
            demo, solved = asyncio.run(demonstration(env, env.sample_task(rng)))
            failed += not solved
            if not solved and not keep_unsolved:
                continue
            f.write(json.dumps(demo) + "\n")
            written += 1
            if written % 100 == 0 or written == episodes:
                progress(f"demonstrations: {written}/{episodes}")
    tmp.replace(out)
    return {"written": written, "unsolved": failed}
