"""reasoning-gym's procedural datasets as rlstream environments: ``reasoning-gym:DATASET``.

A task is one entry of the dataset, named by the seed it is generated from (a dataset of
one entry made with that seed), so producers and held-out evaluations, which draw their
seeds from different random streams, see different questions without a shared index. The
question is the prompt; the model's answer (the text inside ``<answer>...</answer>`` when
it writes one, else its whole turn) is scored by the dataset's own ``score_answer``, and
that score is the reward. With ``attempts`` above 1 a wrong answer is told so and the
model answers again (multi-turn: the reward is the last answer's score).

Options: ``attempts`` (1), ``max_answer_chars`` (4,096: longer answers are cut before
scoring) and any field of the dataset's own config (``--env-option min_terms=2``); a field
the dataset does not have is refused with the dataset's reason.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import random
from collections.abc import Sequence
from typing import Any

from connectors.base import SEEDS, Environment, Step, Task, seed_of, seeded_task
from pipeline.errors import InvalidConfigError
from pipeline.records.trajectory import SOLVED


class ReasoningGym(Environment):
    def __init__(
        self, dataset: str, attempts: int = 1, max_answer_chars: int = 4096, **config: Any
    ) -> None:
        import reasoning_gym

        if not isinstance(attempts, int) or isinstance(attempts, bool) or not 1 <= attempts <= 16:
            raise InvalidConfigError(
                f"reasoning-gym: attempts must lie in [1, 16], got {attempts!r}"
            )
        if not isinstance(max_answer_chars, int) or not 1 <= max_answer_chars <= 1 << 20:
            raise InvalidConfigError(
                f"reasoning-gym: max_answer_chars must lie in [1, 2**20], got {max_answer_chars!r}"
            )
        if "seed" in config or "size" in config:
            raise InvalidConfigError(
                "reasoning-gym: seed and size are rlstream's (each task is a seed it draws)"
            )
        self.name = "reasoning-gym-" + dataset
        self.dataset, self.attempts, self.max_answer_chars = dataset, attempts, max_answer_chars
        self.config = dict(config)
        self._create = reasoning_gym.create_dataset
        self._entry: dict[str, Any] | None = None
        self._data: Any = None
        self._tries = 0
        self._build(0)  # an unknown dataset or a bad config field is refused now

    def _build(self, seed: int) -> dict[str, Any]:
        try:
            data = self._create(self.dataset, size=1, seed=seed, **self.config)
        except (TypeError, ValueError, AssertionError, KeyError) as e:
            raise InvalidConfigError(f"reasoning-gym:{self.dataset}: {e}"[:500]) from None
        self._data = data
        entry = data[0]
        if not isinstance(entry, dict) or not isinstance(entry.get("question"), str):
            raise ValueError(f"reasoning-gym:{self.dataset} gave an entry without a question")
        return entry

    def sample_task(self, rng: random.Random) -> Task:
        return seeded_task(self.name, rng)

    async def reset(self, task: Task) -> str:
        self._entry = self._build(seed_of(task, "reasoning-gym"))
        self._tries = 0
        return str(self._entry["question"])

    async def step(self, action: str) -> Step:
        if self._entry is None:
            raise RuntimeError("step before reset")
        self._tries += 1
        answer = _answer(action[: self.max_answer_chars])
        score = float(self._data.score_answer(answer, self._entry))
        if not math.isfinite(score):
            raise ValueError(f"score_answer gave {score!r}")
        last = self._tries >= self.attempts
        solved = score >= 1.0
        # success is solving it: datasets give partial credit (basic_arithmetic: the share of
        # an answer that the right one is, when it contains it), which a positive reward
        # would count
        info = {"solved": solved, "score": score, "rewards": {SOLVED: float(solved)}}
        if solved or last:
            return Step("Correct." if solved else "Not correct.", score, True, info)
        left = self.attempts - self._tries
        return Step(f"Not correct. Try again ({left} left).", 0.0, False, info)

    def random_success(self) -> float | None:
        """What an agent that ignores the question reaches, the better of: answering with
        the answer of another question of the dataset (its answers' distribution: the
        random valid answer) and always giving the dataset's most common answer; over 400
        questions."""
        return _question_blind(self.dataset, json.dumps(self.config, sort_keys=True))


@functools.lru_cache(maxsize=64)
def _question_blind(dataset: str, config_json: str, n: int = 400) -> float | None:
    import reasoning_gym

    rng = random.Random(0)
    try:
        data = reasoning_gym.create_dataset(
            dataset, size=n, seed=rng.randrange(SEEDS), **json.loads(config_json)
        )
        entries = [data[i] for i in range(n)]
        answers = [str(e["answer"]) for e in entries]
        common = collections.Counter(answers).most_common(1)[0][0]
        half = n // 2

        def rate(given: Sequence[str], asked: Sequence[dict[str, Any]]) -> float:
            right = (
                float(data.score_answer(a, e)) >= 1.0 for a, e in zip(given, asked, strict=True)
            )
            return sum(right) / len(asked)

        prior = rate(answers[half:], entries[:half])
        constant = rate([common] * n, entries)
    except Exception:  # a dataset whose entries cannot be scored so: no baseline known
        return None
    return max(prior, constant)


def _answer(text: str) -> str:
    """The answer inside the last ``<answer>...</answer>``, else the whole text, stripped."""
    start = text.rfind("<answer>")
    if start >= 0:
        end = text.find("</answer>", start)
        if end >= 0:
            return text[start + len("<answer>") : end].strip()
    return text.strip()
