"""The ``gym`` connector: a Gymnasium environment whose observations and actions are text
(``pip install 'rlstream[gymnasium]'``; Gymnasium is not a core dependency).

``--env gym --env-option id=my_package.envs:WordGame-v0 --env-option name=wordgame``

``id`` is anything ``gymnasium.make`` takes, including ``module:EnvId`` to import the
module that registers it. Tasks are reset seeds. Gymnasium environments are synchronous:
their calls run in worker threads so that other episodes go on meanwhile. An observation
that is not text is an environment error; ``info`` is kept as plain JSON data.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Mapping
from typing import Any

from connectors.base import Environment, SeedTask, Step, Task
from connectors.protocol import plain
from pipeline.errors import InvalidConfigError


def _gymnasium() -> Any:
    try:
        import gymnasium
    except ImportError:
        raise InvalidConfigError(
            "the gym connector needs Gymnasium: pip install 'rlstream[gymnasium]'"
        ) from None
    return gymnasium


class GymEnvironment(Environment):
    """One episode of Gymnasium environment ``id``, made with ``kwargs``."""

    name = "gym"  # (the ``name`` option overrides it)

    def __init__(self, id: str, name: str = "gym", kwargs: Mapping[str, Any] | None = None) -> None:
        self.gymnasium = _gymnasium()
        self.id, self.name, self.kwargs = id, name, dict(kwargs or {})
        self._env: Any = None

    def sample_task(self, rng: random.Random) -> Task:
        seed = rng.randrange(2**31)
        return SeedTask(f"{self.id}-seed-{seed}", {}, seed)

    async def reset(self, task: Task) -> str:
        seed = task.seed if isinstance(task, SeedTask) else task.params.get("seed")
        options = {k: v for k, v in task.params.items() if k != "seed"} or None
        self._env = await asyncio.to_thread(self._make)
        obs, _info = await asyncio.to_thread(self._env.reset, seed=seed, options=options)
        return _text(obs)

    def _make(self) -> Any:
        try:
            return self.gymnasium.make(self.id, **self.kwargs)
        except self.gymnasium.error.Error as e:
            raise InvalidConfigError(f"gymnasium environment {self.id!r}: {e}") from e

    async def step(self, action: str) -> Step:
        obs, reward, terminated, truncated, info = await asyncio.to_thread(self._env.step, action)
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"reward {reward} is not finite")
        return Step(_text(obs), reward, bool(terminated or truncated), plain(dict(info)))

    async def close(self) -> None:
        env, self._env = self._env, None
        if env is not None:
            await asyncio.to_thread(env.close)


def _text(obs: Any) -> str:
    if not isinstance(obs, str):
        raise TypeError(f"observation is {type(obs).__name__}, not text")
    return obs
