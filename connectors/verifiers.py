"""verifiers environments (Prime Intellect's Environments Hub) as rlstream environments:
``verifiers:MODULE``.

The module is loaded with verifiers' own ``load_environment`` (options are its keyword
arguments), once per process. An episode is the environment's own rollout loop, run as it
runs against an inference server, with rlstream's policy in the server's place: the
environment's client is a bridge that hands each prompt to rlstream's episode loop and
each of the model's turns back. So ``SingleTurnEnv``, ``MultiTurnEnv`` (its
``env_response``, stop conditions and ``max_turns``) and ``ToolEnv`` (its tools, run by the
environment itself on the model's calls) behave as they do in verifiers, and the
environment's rubric scores the finished rollout: its reward is the episode's reward,
each reward function's score a component of the trajectory's ``rewards``.

A task is one row of the environment's dataset; held-out evaluation draws from its
``eval_dataset`` where it has one. Refused by name, at load: rubrics with group-level
reward functions (they score a group together, which one episode cannot), rubrics that
provide their own advantages, and the deprecated completion (non-chat) format. Not
carried over: sampling arguments (rlstream's sampling settings apply), image content (an
episode with one ends ``env_error``), the model's reasoning content.

verifiers' classic API is the one supported (``verifiers>=0.3.1,<0.4``, the ``verifiers``
extra); its dependencies differ from the ``envs`` extra's (it needs ``mcp<2``), so it
goes in an environment of its own, which ``rlstream env serve`` can serve to producers
anywhere.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from connectors.base import Environment, Step, Task
from connectors.tools import Tool, ToolRegistry
from pipeline.errors import InvalidConfigError

_MODEL = "rlstream"
#: the most text, and messages, one observation carries to the model (the episode's
#: token bound applies after it)
MAX_OBSERVATION_CHARS, MAX_MESSAGES = 1 << 16, 64


@functools.lru_cache(maxsize=16)
def _load(module: str, options_json: str) -> Any:
    """The verifiers environment of ``module`` with these options, loaded once."""
    try:
        import verifiers as vf
    except ImportError as e:  # a dependency of verifiers itself is missing
        raise InvalidConfigError(f"verifiers could not be imported: {e}") from None
    version = getattr(vf, "__version__", "0")
    if not hasattr(vf, "load_environment") or not version.startswith("0.3."):
        raise InvalidConfigError(
            f"verifiers {version} is installed; rlstream runs verifiers' classic environments "
            "(pip install 'verifiers>=0.3.1,<0.4', the rlstream[verifiers] extra)"
        )
    try:  # verifiers formats its datasets with `map`, which draws a progress bar per call
        import datasets

        datasets.disable_progress_bars()
    except (ImportError, AttributeError):
        pass
    options = json.loads(options_json)
    try:
        env = vf.load_environment(module, **options)
    except (ValueError, RuntimeError, TypeError) as e:
        raise InvalidConfigError(f"verifiers:{module}: {e}"[:500]) from None
    if not isinstance(env, vf.Environment):
        raise InvalidConfigError(
            f"verifiers:{module}: load_environment returned {type(env).__name__}, "
            "not a verifiers Environment"
        )
    _refuse_unsupported(module, env)
    return env


def _refuse_unsupported(module: str, env: Any) -> None:
    what = f"verifiers:{module}"
    if getattr(env, "message_type", "chat") != "chat":
        raise InvalidConfigError(f"{what}: the completion (non-chat) format is not supported")
    if env.rubric.has_group_rewards:
        raise InvalidConfigError(
            f"{what}: its rubric has group-level reward functions, which score a group "
            "together; rlstream scores each episode alone (GRPO groups are rlstream's)"
        )
    if env.rubric.has_advantages:
        raise InvalidConfigError(
            f"{what}: its rubric provides advantages; rlstream's trainer computes its own"
        )
    if env.build_dataset() is None and env.build_eval_dataset() is None:
        raise InvalidConfigError(f"{what}: the environment has no dataset to draw tasks from")


def _said(messages: Sequence[Any], sep: str) -> str:
    """What the environment said in ``messages``, as one bounded text for the model."""
    text = sep.join(_text(m.content) for m in messages[:MAX_MESSAGES])
    if len(text) > MAX_OBSERVATION_CHARS:
        return text[:MAX_OBSERVATION_CHARS] + " [truncated]"
    return text


def _text(content: Any) -> str:
    """A message's content as text; ValueError for anything but text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else getattr(part, "type", None)
            text = part.get("text") if isinstance(part, Mapping) else getattr(part, "text", None)
            if kind != "text" or not isinstance(text, str):
                raise ValueError(f"a message part of type {kind!r} (only text is supported)")
            texts.append(text)
        return "".join(texts)
    raise ValueError(f"a message content of type {type(content).__name__}")


class _Bridge:
    """Where verifiers' rollout loop and rlstream's episode loop meet: the loop asks for a
    model response with the whole conversation (:meth:`ask`), the episode answers with the
    model's turn (:meth:`answer`) and reads what the environment added since."""

    def __init__(self) -> None:
        self.prompts: asyncio.Queue[list[Any]] = asyncio.Queue(maxsize=1)
        self.response: asyncio.Future[Any] | None = None
        self.seen = 0  # messages of the conversation already shown to the model

    async def ask(self, messages: list[Any]) -> Any:
        self.response = asyncio.get_running_loop().create_future()
        await self.prompts.put(messages)
        return await self.response

    def new_messages(self, messages: list[Any]) -> list[Any]:
        """The messages the environment added since the model's last turn."""
        fresh = messages[self.seen :]
        self.seen = len(messages) + 1  # the model's coming turn is the next message
        return fresh


def _client(bridge: _Bridge) -> Any:
    """A verifiers client whose model is the bridge."""
    from verifiers.clients import Client

    class BridgeClient(Client):
        def setup_client(self, config: Any) -> Any:
            return None

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> tuple[Any, dict[str, Any]]:
            return list(messages), {}

        async def get_native_response(
            self, prompt: Any, model: str, sampling_args: Any, tools: Any = None, **kwargs: Any
        ) -> Any:
            return await bridge.ask(prompt)

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: Any) -> Any:
            return response

        async def close(self) -> None:
            return None

    return BridgeClient(None)


def _response(content: str | None, calls: Sequence[tuple[str, str]] = ()) -> Any:
    from verifiers.types import Response, ResponseMessage, ToolCall

    tool_calls = [
        ToolCall(id=f"call_{uuid.uuid4().hex[:12]}", name=n, arguments=a) for n, a in calls
    ]
    return Response(
        id=uuid.uuid4().hex,
        created=int(time.time()),
        model=_MODEL,
        message=ResponseMessage(
            content=content,
            tool_calls=tool_calls or None,
            finish_reason="tool_calls" if tool_calls else "stop",
            is_truncated=False,
        ),
    )


class Verifiers(Environment):
    def __init__(self, module: str, **options: Any) -> None:
        parts = module.replace("-", "_").split(".")
        if not all(part.isidentifier() for part in parts):
            raise InvalidConfigError(f"verifiers: {module!r} is not a module name")
        try:
            options_json = json.dumps(options, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise InvalidConfigError(f"verifiers:{module}: options must be JSON: {e}") from None
        self.name = "verifiers-" + module
        self.env = _load(module, options_json)
        self.module = module
        self.tools = _tools(self.env)
        self._bridge: _Bridge | None = None
        self._rollout: asyncio.Task[Any] | None = None
        self._ended: Step | None = None

    def _rows(self, split: str) -> Any:
        """The dataset of ``split`` ("train" or "eval"), or None where it has none."""
        return self.env.build_eval_dataset() if split == "eval" else self.env.build_dataset()

    def _task(self, rng: random.Random, held_out: bool) -> Task:
        # held out: the eval dataset where there is one; either way the one that exists
        prefer, other = ("eval", "train") if held_out else ("train", "eval")
        split = prefer if self._rows(prefer) is not None else other
        index = rng.randrange(len(self._rows(split)))
        return Task(f"{self.name}-{split}-{index}", {"split": split, "row": index})

    def sample_task(self, rng: random.Random) -> Task:
        return self._task(rng, held_out=False)

    def held_out_task(self, rng: random.Random) -> Task:
        return self._task(rng, held_out=True)

    async def reset(self, task: Task) -> str:
        split, index = task.params.get("split"), task.params.get("row")
        rows = self._rows(split) if split in ("train", "eval") else None
        if rows is None or not isinstance(index, int) or not 0 <= index < len(rows):
            raise ValueError(f"verifiers task {task.task_id!r} names no row")
        bridge = self._bridge = _Bridge()
        row = dict(rows[index])
        self._rollout = asyncio.create_task(
            self.env.rollout(row, _client(bridge), _MODEL, {}), name=f"verifiers-{self.module}"
        )
        messages = await self._next()
        if messages is None:
            raise ValueError("the environment ended its rollout before the model's first turn")
        return _said(bridge.new_messages(messages), "\n\n")

    async def _next(self) -> list[Any] | None:
        """The next conversation the environment asks the model about, or None once its
        rollout has ended (then ``_ended`` holds the scored last step)."""
        assert self._bridge is not None and self._rollout is not None
        asked = asyncio.ensure_future(self._bridge.prompts.get())
        try:
            done, _ = await asyncio.wait(
                {asked, self._rollout}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:  # also when the episode's step timeout cancels this wait
            if not asked.done():
                asked.cancel()
        if asked in done:
            return asked.result()
        self._ended = await self._score(self._rollout.result())
        return None

    async def _score(self, state: Any) -> Step:
        error = state.get("error")
        if error is not None:
            raise ValueError(f"the environment's rollout failed: {error!r}"[:500])
        await self.env.rubric.score_rollout(state)
        await self.env.rubric.cleanup(state)
        reward = state.get("reward")
        number = isinstance(reward, int | float) and not isinstance(reward, bool)
        if not number or not math.isfinite(reward):
            raise ValueError(f"the rubric gave the reward {reward!r}")
        # each reward function's score, a component (the episode keeps the finite ones)
        metrics = state.get("metrics")
        return Step(
            "", float(reward), True, {"rewards": metrics if isinstance(metrics, dict) else {}}
        )

    async def _answer(self, response: Any) -> list[Any] | None:
        if self._ended is not None:
            return None
        bridge = self._bridge
        if bridge is None or bridge.response is None or bridge.response.done():
            raise RuntimeError("step before reset")
        bridge.response.set_result(response)
        return await self._next()

    async def step(self, action: str) -> Step:
        messages = await self._answer(_response(action))
        if messages is None:
            assert self._ended is not None
            return self._ended
        assert self._bridge is not None
        return Step(_said(self._bridge.new_messages(messages), "\n\n"))

    async def call_tool(self, name: str, arguments: str) -> str:
        if self.tools is None or name not in self.tools:
            raise KeyError(name)
        text = arguments.strip()
        if not text.startswith("{"):  # the bare form of a one-string tool: its JSON object
            try:
                text = json.dumps(self.tools.parse_arguments(name, text))
            except ValueError as e:
                return f"error: {e}"
        messages = await self._answer(_response(None, [(name, text)]))
        if messages is None:
            return "error: the environment has ended the episode"
        assert self._bridge is not None
        return _said(self._bridge.new_messages(messages), "\n")

    async def close(self) -> None:
        rollout, self._rollout = self._rollout, None
        if rollout is not None and not rollout.done():
            rollout.cancel()
            try:
                await rollout
            except BaseException:  # the cancellation, or whatever the rollout raised
                pass


def _tools(env: Any) -> ToolRegistry | None:
    """The environment's tools as rlstream lists them to the model (verifiers runs them)."""
    defs = getattr(env, "tool_defs", None) or []
    if not defs:
        return None

    async def run_by_the_environment(**_: Any) -> str:
        raise RuntimeError("verifiers tools run inside the environment's rollout")

    registry = ToolRegistry()
    for d in defs:
        get = d.get if isinstance(d, Mapping) else functools.partial(getattr, d)
        registry.add(
            Tool(
                str(get("name")),
                str(get("description") or ""),
                dict(get("parameters") or {"type": "object", "properties": {}}),
                run_by_the_environment,
            )
        )
    return registry
