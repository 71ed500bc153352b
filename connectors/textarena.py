"""TextArena's single-player games as rlstream environments: ``textarena:ENV_ID``.

``textarena:GuessTheNumber-v0``, ``textarena:Mastermind-v0``, ``textarena:TowerOfHanoi-v0``
or any other game TextArena registers that one player can play. The game is made with
TextArena's own ``make`` (its default wrappers: the LLM observation and the action
formatting a model's answer needs), reset with the task's seed, and played turn by turn:
the first observation is the prompt, each turn's new text (what the game said since the
last turn, without the echo of the model's own move) is the next observation, and when the
game is done the reward TextArena gives player 0 is the episode's reward (a win is 1).

Options: ``max_observation_chars`` (16,384: a longer observation is cut), and any keyword
of the game's own constructor (``--env-option num_guesses=8``), refused with the game's
reason when it has no such keyword. Games for two or more players are refused by name.
"""

from __future__ import annotations

import math
import random
from typing import Any

from connectors.base import Environment, Step, Task, seed_of, seeded_task
from pipeline.errors import InvalidConfigError


class TextArena(Environment):
    def __init__(self, env_id: str, max_observation_chars: int = 16384, **kwargs: Any) -> None:
        import textarena

        if not isinstance(max_observation_chars, int) or not 64 <= max_observation_chars <= 1 << 20:
            raise InvalidConfigError(
                "textarena: max_observation_chars must lie in [64, 2**20], got "
                f"{max_observation_chars!r}"
            )
        self.name = "textarena-" + env_id
        self.env_id, self.kwargs = env_id, dict(kwargs)
        self.max_observation_chars = max_observation_chars
        self._ta = textarena
        self._game: Any = None
        self._seen = ""  # the full observation as of the last turn
        self._playing = False
        self._make()  # an unknown game, a bad keyword or a game for several players: now
        self._start(0)
        self._playing = False  # that game was a check: an episode starts with reset

    def _make(self) -> Any:
        try:
            self._game = self._ta.make(self.env_id, **self.kwargs)
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise InvalidConfigError(f"textarena:{self.env_id}: {e}"[:500]) from None
        except LookupError as e:  # a corpus the game loads (NLTK's) is not installed
            said = [line.strip() for line in str(e).splitlines() if any(c.isalpha() for c in line)]
            raise InvalidConfigError(
                f"textarena:{self.env_id} needs data it could not load "
                f"({(said or ['no reason given'])[0][:200]}); for NLTK's corpora: "
                "python -m nltk.downloader words averaged_perceptron_tagger_eng"
            ) from None
        return self._game

    def _start(self, seed: int) -> str:
        try:
            self._game.reset(num_players=1, seed=seed)
        except (ValueError, AssertionError, TypeError) as e:
            raise InvalidConfigError(
                f"textarena:{self.env_id} is not a single-player game ({e})"[:500]
            ) from None
        player, observation = self._game.get_observation()
        if player != 0:
            raise InvalidConfigError(f"textarena:{self.env_id} is not a single-player game")
        self._seen, self._playing = str(observation), True
        return self._cut(self._seen.strip())

    def sample_task(self, rng: random.Random) -> Task:
        return seeded_task(self.name, rng)

    async def reset(self, task: Task) -> str:
        return self._start(seed_of(task, "textarena"))

    async def step(self, action: str) -> Step:
        if not self._playing:
            raise RuntimeError("step before reset")
        done, _ = self._game.step(action[: self.max_observation_chars])
        if done:
            rewards, game_info = self._game.close()
            reward = (rewards or {}).get(0)
            if not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise ValueError(f"textarena:{self.env_id} ended with reward {reward!r}")
            reason = str((game_info or {}).get(0, {}).get("reason", ""))[:500]
            self._playing = False
            return Step(reason or "The game is over.", float(reward), True, {"game": reason})
        _, observation = self._game.get_observation()
        observation = str(observation)
        new = observation[len(self._seen) :] if observation.startswith(self._seen) else observation
        self._seen = observation
        return Step(self._cut(_without_echo(new)), 0.0, False, {})

    def _cut(self, text: str) -> str:
        return text[: self.max_observation_chars]


def _without_echo(text: str) -> str:
    """The game's new text without the lines that repeat the (only) player's own move."""
    lines = [line for line in text.strip().splitlines() if not line.startswith("[Player]")]
    return "\n".join(lines).strip() or "(no answer from the game)"
