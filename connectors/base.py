"""The environment contract, and a registry so that ``--env NAME`` finds one.

An :class:`Environment` is asynchronous: ``reset(task)`` returns the first observation,
``step(action)`` takes the agent's text and returns a :class:`Step`. An environment may
expose tools (a :class:`~connectors.tools.ToolRegistry`); the agent calls one by writing
``<call>name arguments</call>``, and the producer runs it and returns the result as a
tool observation. Environments that live elsewhere implement the same contract through
connectors: ``http`` (:mod:`connectors.http`), ``process`` (:mod:`connectors.process`)
and ``gym`` (:mod:`connectors.gym`).

Failures are per episode: an exception or a timeout ends that episode with status
``env_error`` or ``timeout``; the producer and the other episodes go on.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import importlib
import json
import logging
import math
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from connectors.tools import ToolRegistry
from pipeline.errors import InvalidConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Task:
    """What one GRPO group is sampled for: an id and the environment's parameters."""

    task_id: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SeedTask(Task):
    """A task named only by a seed, for environments that sample their own tasks
    elsewhere (a server, a child process): they draw it from ``Random(seed)``."""

    seed: int = 0

    @classmethod
    def draw(cls, rng: random.Random) -> SeedTask:
        """A new seed task from ``rng`` (what a remote environment's ``sample_task`` is)."""
        seed = rng.randrange(2**31)
        return cls(f"seed-{seed}", {}, seed)


#: seeds of seeded tasks are drawn below this
SEEDS = 2**31


def seeded_task(name: str, rng: random.Random) -> Task:
    """A task of environment ``name`` that is one seed (``params["seed"]``) of a game or
    a dataset generated from it (reasoning-gym's, TextArena's)."""
    seed = rng.randrange(SEEDS)
    return Task(f"{name}-{seed}", {"seed": seed})


def seed_of(task: Task, what: str) -> int:
    """The seed of a :func:`seeded_task`; ValueError for anything else a task may carry."""
    seed = task.params.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < SEEDS:
        raise ValueError(f"{what} task {task.task_id!r} has no valid seed")
    return seed


@dataclass(frozen=True)
class Step:
    """The environment's answer to one action."""

    observation: str
    reward: float = 0.0
    done: bool = False
    #: anything the environment reports; ``info["rewards"]``, names to finite numbers, are
    #: the reward's components (a rubric's functions), kept in the trajectory's ``rewards``
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


def with_latency(options: Mapping[str, Any], latency_ms: float, sigma: float) -> dict[str, Any]:
    """An environment's options with a simulated :class:`LatencyModel` (none at 0 ms)."""
    if latency_ms <= 0:
        return dict(options)
    return {**options, "latency": LatencyModel(latency_ms / 1000, sigma)}


class Environment(abc.ABC):
    """One episode's environment. Instances are not shared between episodes.

    Contract: ``reset`` is awaited once, then ``step`` until it returns ``done``;
    ``tools`` maps a tool name to an async function of the argument text returning the
    result text. Any exception is an environment error for this episode only.
    """

    #: Name in the registry and in every trajectory (and so of its rollout topic).
    name: str = ""
    #: Tools the agent may call; None: no tools.
    tools: ToolRegistry | None = None

    @abc.abstractmethod
    def sample_task(self, rng: random.Random) -> Task:
        """A new task (the environment's randomness comes from ``rng`` only)."""

    def held_out_task(self, rng: random.Random) -> Task:
        """A task for held-out evaluation: by default one of :meth:`sample_task`'s, drawn
        from a stream producers do not use; an environment with a held-out set of its own
        (a dataset's evaluation split) draws from that."""
        return self.sample_task(rng)

    @abc.abstractmethod
    async def reset(self, task: Task) -> str:
        """Start an episode of ``task``; return the first observation (the prompt)."""

    @abc.abstractmethod
    async def step(self, action: str) -> Step:
        """Apply the agent's action (its turn's text without tool calls)."""

    async def call_tool(self, name: str, arguments: str) -> str:
        """Run tool ``name`` on the agent's argument text; the result or the error is
        text for the agent. Raise :class:`KeyError` if there is no such tool."""
        if self.tools is None:
            raise KeyError(name)
        return (await self.tools.call(name, arguments)).text

    async def demonstrate(
        self, task: Task, call: Callable[[str, dict[str, Any]], Awaitable[str]]
    ) -> str | None:
        """A scripted solver of ``task``, after :meth:`reset`: it calls tools through
        ``await call(name, arguments)`` (which returns the tool's result) and returns its
        final answer; the demonstrations ``rlstream env demos`` writes for ``rlstream
        sft``. None (the default): the environment has no solver."""
        return None

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release what the episode holds (sessions, processes)."""

    def random_success(self) -> float | None:
        """The success rate of an agent that answers uniformly at random among the valid
        answers: the baseline a run's report compares its policy with. None: not known."""
        return None


#: environments by name: a factory, or where to import one from ("module:attribute"),
#: imported on first use (so that listing or naming environments builds none of them)
_REGISTRY: dict[str, Callable[..., Environment] | str] = {
    "guess": "connectors.builtin:GuessNumber",
    "calc": "connectors.builtin:Calculator",
    "echo": "connectors.builtin:Echo",
    "lookup": "connectors.builtin:Lookup",
    "gym": "connectors.gym:GymEnvironment",
    "http": "connectors.http:HttpEnvironment",
    "process": "connectors.process:ProcessEnvironment",
}


@dataclass(frozen=True)
class Adapter:
    """An ecosystem's environments, named ``PREFIX:ARGUMENT`` (``reasoning-gym:leg_counting``):
    ``factory(ARGUMENT, **options)`` builds one; ``package`` is what it imports, installed
    with ``extra``."""

    prefix: str
    factory: str
    package: str
    extra: str
    what: str


#: the ecosystems whose environments are named by a prefix
ADAPTERS: dict[str, Adapter] = {
    a.prefix: a
    for a in (
        Adapter(
            "reasoning-gym",
            "connectors.reasoning_gym:ReasoningGym",
            "reasoning_gym",
            "envs",
            "any reasoning-gym dataset: reasoning-gym:DATASET (options: its config fields, "
            "attempts)",
        ),
        Adapter(
            "textarena",
            "connectors.textarena:TextArena",
            "textarena",
            "envs",
            "any single-player TextArena game: textarena:ENV_ID (options: the game's keywords)",
        ),
        Adapter(
            "verifiers",
            "connectors.verifiers:Verifiers",
            "verifiers",
            "verifiers",
            "a verifiers environment: verifiers:MODULE (options: its load_environment's arguments)",
        ),
        Adapter(
            "openenv",
            "connectors.openenv:OpenEnv",
            "aiohttp",
            "envs",
            "an OpenEnv server: openenv:URL (options: action_field, observation_field)",
        ),
    )
}


def register(name: str, factory: Callable[..., Environment] | str) -> None:
    """Make ``factory(**options)`` available as environment ``name``; ``factory`` may be
    an import string ``"package.module:Class"``, imported when first used."""
    _REGISTRY[name] = factory


def registered() -> list[str]:
    """Names of the registered environments and connectors."""
    return sorted(_REGISTRY)


class _Bound:
    """An adapter's factory with its argument: what ``factory("PREFIX:ARG")`` returns,
    named after both (the trajectories' and the rollout topic's name)."""

    def __init__(self, make_: Callable[..., Environment], argument: str, name: str) -> None:
        self._make, self.argument, self.name = make_, argument, name

    def __call__(self, **options: Any) -> Environment:
        return self._make(self.argument, **options)


def _import(spec: str, what: str) -> Any:
    module, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise InvalidConfigError(f"environment {what!r}: cannot load {spec}: {e}") from None


def factory(name: str) -> Callable[..., Environment]:
    """The factory of environment ``name``: a registered name, an ecosystem's
    ``PREFIX:ARGUMENT`` (:data:`ADAPTERS`) or a user's own ``package.module:Class`` (an
    :class:`Environment` subclass), imported now."""
    entry = _REGISTRY.get(name)
    if entry is None:
        prefix, sep, argument = name.partition(":")
        adapter = ADAPTERS.get(prefix)
        if adapter is not None:
            return _adapter(adapter, argument, name)
        if not sep or not argument:
            raise InvalidConfigError(_unknown(name))
        cls = _import(name, name)
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise InvalidConfigError(
                f"environment {name!r} is not a subclass of connectors.base.Environment"
            )
        _REGISTRY[name] = cls
        return cls
    if isinstance(entry, str):
        entry = _import(entry, name)
        _REGISTRY[name] = entry
    return entry


def _unknown(name: str) -> str:
    return (
        f"unknown environment {name!r}: registered are {', '.join(sorted(_REGISTRY))}; "
        f"an ecosystem's is {' or '.join(p + ':NAME' for p in ADAPTERS)}; your own class "
        "is package.module:Class"
    )[:600]


def _adapter(adapter: Adapter, argument: str, name: str) -> Callable[..., Environment]:
    if not argument:
        raise InvalidConfigError(f"environment {name!r}: {adapter.prefix} needs a name after ':'")
    try:
        importlib.import_module(adapter.package)
    except ImportError:
        raise InvalidConfigError(
            f"environment {name!r} needs the {adapter.package} package: "
            f"pip install 'rlstream[{adapter.extra}]'"
        ) from None
    return _Bound(_import(adapter.factory, name), argument, f"{adapter.prefix}-{argument}")


def make(name: str, /, tools: Sequence[str] = (), **options: Any) -> Environment:
    """A new environment instance of registered ``name``; with ``tools`` (``mcp:COMMAND``
    or ``mcp:URL``, :mod:`connectors.mcp`) those servers' tools are added to its own."""
    try:
        env = factory(name)(**options)
    except TypeError as e:
        shown = str(options)[:300]
        raise InvalidConfigError(f"environment {name!r}: bad options {shown}: {e}") from None
    return WithTools(env, tools) if tools else env


class WithTools(Environment):
    """An environment with the tools of MCP servers besides its own: the servers'
    connections are the event loop's (:func:`shared`), listed when an episode starts; a
    call to one of their tools goes to its server, any other call to the environment."""

    def __init__(self, inner: Environment, specs: Sequence[str]) -> None:
        from connectors.mcp import check_spec

        self.inner = inner
        self.specs = tuple(check_spec(s) for s in specs)
        self.name = inner.name
        self.tools = inner.tools
        self._served: ToolRegistry | None = None

    def sample_task(self, rng: random.Random) -> Task:
        return self.inner.sample_task(rng)

    def held_out_task(self, rng: random.Random) -> Task:
        return self.inner.held_out_task(rng)

    async def reset(self, task: Task) -> str:
        from connectors.mcp import McpServer

        served = ToolRegistry()
        for spec in self.specs:
            make_server = functools.partial(McpServer, spec)
            server = shared(("mcp", spec), make_server)
            if server.gone:  # the last connection ended (the server died): a new one
                await server.aclose()
                server = renew(("mcp", spec), make_server)
            for tool in await server.connect():
                served.add(tool)
        self._served = served
        # a name offered twice (by two servers, or a server and the environment) is refused
        self.tools = ToolRegistry([*(self.inner.tools or []), *served])
        return await self.inner.reset(task)

    async def step(self, action: str) -> Step:
        return await self.inner.step(action)

    async def call_tool(self, name: str, arguments: str) -> str:
        if self._served is not None and name in self._served:
            return (await self._served.call(name, arguments)).text
        return await self.inner.call_tool(name, arguments)

    async def close(self) -> None:
        await self.inner.close()

    def random_success(self) -> float | None:
        return self.inner.random_success()


def env_name(name: str, options: Mapping[str, Any] | None = None) -> str:
    """The name trajectories of environment ``name`` carry, the one its rollout topic is
    named after, without building it: the ``name`` option of a connector that takes one,
    else the class's ``name``."""
    options = dict(options or {})
    if isinstance(options.get("name"), str):
        return str(options["name"])
    return topic_safe(str(getattr(factory(name), "name", "") or name))


def topic_safe(text: str) -> str:
    """``text`` as a name a Kafka topic can carry (an adapter's argument, a URL, a user's
    package.module:Class): other characters become ``-``."""
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in text)[:200]


class SharedResource(Protocol):
    async def aclose(self) -> None: ...


R = TypeVar("R", bound=SharedResource)
_SHARED: dict[tuple[asyncio.AbstractEventLoop, Any], SharedResource] = {}


def shared(key: Any, factory: Callable[[], R]) -> R:
    """One resource per event loop and ``key`` (an HTTP connection pool, a pool of
    child processes) for all the episodes of a producer; :func:`close_shared` ends them."""
    loop = asyncio.get_running_loop()
    res = _SHARED.get((loop, key))
    if res is None:
        res = _SHARED[(loop, key)] = factory()
    return res  # type: ignore[return-value]


def renew(key: Any, factory: Callable[[], R]) -> R:
    """A new resource in place of ``key``'s (the old one is left to its users and closed
    by :func:`close_shared` no more: it has ended)."""
    loop = asyncio.get_running_loop()
    res = _SHARED[(loop, key)] = factory()
    return res


async def close_shared() -> None:
    """Close every shared resource of the running loop (at the end of a producer)."""
    loop = asyncio.get_running_loop()
    for k in [k for k in _SHARED if k[0] is loop]:
        try:
            await _SHARED.pop(k).aclose()
        except Exception as e:  # closing is best effort
            log.warning("closing %s failed: %r", k[1], e)


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
