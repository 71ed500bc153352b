"""An OpenEnv environment server made with openenv-core's own classes (``Environment``,
``Action``, ``Observation``, ``create_app``), for rlstream's tests:
``python -m tests.openenv_server PORT``. The game: guess a number from 1 to 16 in 6 tries,
told higher or lower; a guess of 0 makes the server answer with a non-finite reward, a
guess of 99 with an observation of two megabytes, a guess of 77 hangs."""

from __future__ import annotations

import random
import sys
import time
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    guess: str = Field(..., description="the number guessed, as text")


class GuessObservation(Observation):
    message: str = Field(default="", description="what the game says")


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id="", step_count=0)
        self.secret, self.left = 0, 0

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **_: Any
    ) -> GuessObservation:
        self.secret = random.Random(seed).randint(1, 16)
        self.left = 6
        self._state = State(episode_id=episode_id or str(seed), step_count=0)
        return GuessObservation(message="Guess my number from 1 to 16.", reward=0.0)

    def step(
        self, action: GuessAction, timeout_s: float | None = None, **_: Any
    ) -> GuessObservation:
        self._state.step_count += 1
        self.left -= 1
        text = action.guess.strip()
        if text == "0":
            return GuessObservation(message="broken", reward=float("nan"), done=False)
        if text == "99":
            return GuessObservation(message="y" * 2_000_000, reward=0.0)
        if text == "77":
            time.sleep(3600)
        try:
            guess = int(text)
        except ValueError:
            return GuessObservation(message="Say a number.", reward=0.0, done=self.left <= 0)
        if guess == self.secret:
            return GuessObservation(message="Right.", reward=1.0, done=True)
        said = "Higher." if guess < self.secret else "Lower."
        return GuessObservation(message=said, reward=0.0, done=self.left <= 0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64
)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
