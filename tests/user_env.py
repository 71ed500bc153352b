"""A user's own environment, as a package outside rlstream would define it."""

from __future__ import annotations

import random

from connectors.base import Environment, Step, Task


class Echo(Environment):
    """Say the word back."""

    def __init__(self, word: str = "hello") -> None:
        self.word = word

    def sample_task(self, rng: random.Random) -> Task:
        return Task(f"echo-{self.word}")

    async def reset(self, task: Task) -> str:
        return f"Say {self.word}."

    async def step(self, action: str) -> Step:
        return Step("", float(action.strip() == self.word), True)


NOT_AN_ENVIRONMENT = 3
