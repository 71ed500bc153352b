"""The environment contract, and a registry so that ``--env NAME`` finds one.

An :class:`Environment` is asynchronous: ``reset(task)`` returns the first observation,
``step(action)`` takes the agent's text and returns a :class:`Step`. An environment may
expose tools; the agent calls one by writing ``<call>name arguments</call>``, and the
producer runs it and returns the result as a tool observation. Environments that live
elsewhere (HTTP, subprocesses) implement the same contract through connectors.

Failures are per episode: an exception or a timeout ends that episode with status
``env_error`` or ``timeout``; the producer and the other episodes go on.
"""

from __future__ import annotations

import abc
import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import InvalidConfigError


@dataclass(frozen=True)
class Task:
    """What one GRPO group is sampled for: an id and the environment's parameters."""

    task_id: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    """The environment's answer to one action."""

    observation: str
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LatencyModel:
    """Simulated latency: log-normal with median ``median_s`` and shape ``sigma``, so
    most calls are fast and a few are very slow (a heavy tail, like real tools), capped at
    ``cap_s``. ``median_s`` 0 means no delay."""

    median_s: float = 0.0
    sigma: float = 1.0
    cap_s: float = 10.0

    def sample(self, rng: random.Random) -> float:
        if self.median_s <= 0:
            return 0.0
        return min(self.cap_s, self.median_s * math.exp(rng.gauss(0.0, self.sigma)))


class Environment(abc.ABC):
    """One episode's environment. Instances are not shared between episodes.

    Contract: ``reset`` is awaited once, then ``step`` until it returns ``done``;
    ``tools`` maps a tool name to an async function of the argument text returning the
    result text. Any exception is an environment error for this episode only.
    """

    #: Name in the registry and in every trajectory.
    name: str = ""
    #: Tools the agent may call, described for the prompt: ``{name: description}``.
    tool_descriptions: Mapping[str, str] = {}

    @abc.abstractmethod
    def sample_task(self, rng: random.Random) -> Task:
        """A new task (the environment's randomness comes from ``rng`` only)."""

    @abc.abstractmethod
    async def reset(self, task: Task) -> str:
        """Start an episode of ``task``; return the first observation (the prompt)."""

    @abc.abstractmethod
    async def step(self, action: str) -> Step:
        """Apply the agent's action (its turn's text without tool calls)."""

    async def call_tool(self, name: str, arguments: str) -> str:
        """Run tool ``name``; raise :class:`KeyError` if there is no such tool."""
        raise KeyError(name)

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release what the episode holds (sessions, processes)."""


_REGISTRY: dict[str, Callable[..., Environment]] = {}


def register(name: str, factory: Callable[..., Environment]) -> None:
    """Make ``factory(**options)`` available as environment ``name``."""
    _REGISTRY[name] = factory


def make(name: str, **options: Any) -> Environment:
    """A new environment instance of registered ``name``."""
    _load_builtins()
    if name not in _REGISTRY:
        raise InvalidConfigError(
            f"unknown environment {name!r}: registered are {', '.join(sorted(_REGISTRY))}"
        )
    try:
        return _REGISTRY[name](**options)
    except TypeError as e:
        raise InvalidConfigError(f"environment {name!r}: bad options {options}: {e}") from None


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings (as given to ``--env-option``) as constructor options; a
    VALUE that parses as JSON is taken as such (numbers, booleans, lists)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise InvalidConfigError(f"environment option {item!r} is not KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _load_builtins() -> None:
    import connectors.builtin  # noqa: F401  (registers on import)
