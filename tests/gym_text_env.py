"""A Gymnasium environment with text observations and actions, for the gym connector
tests: guess a number from 1 to 8 (the seed decides it), told higher or lower."""

from __future__ import annotations

import string
from typing import Any

import gymnasium
from gymnasium import spaces


class GuessText(gymnasium.Env[str, str]):
    def __init__(self, max_turns: int = 4, numeric_observation: bool = False) -> None:
        self.observation_space = spaces.Text(max_length=64, charset=string.printable)
        self.action_space = spaces.Text(max_length=64, charset=string.printable)
        self.max_turns, self.numeric = max_turns, numeric_observation
        self.secret, self.turns = 1, 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        self.secret = int(self.np_random.integers(1, 9))
        self.turns = 0
        obs: Any = "Guess my number from 1 to 8."
        return (7 if self.numeric else obs), {"secret": self.secret}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turns += 1
        guess = int(action) if action.strip().isdigit() else 0
        if guess == self.secret:
            return "Correct!", 1.0, True, False, {"turns": self.turns}
        hint = "Higher." if guess < self.secret else "Lower."
        return hint, 0.0, False, self.turns >= self.max_turns, {"turns": self.turns}


gymnasium.register("GuessText-v0", entry_point=GuessText)
