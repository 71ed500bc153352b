"""Environments named the way users of other ecosystems name them, and their own classes."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from connectors import base
from connectors.base import Adapter, env_name, make
from pipeline.errors import InvalidConfigError


def test_a_users_own_class_is_named_by_its_import_path() -> None:
    env = make("tests.user_env:Echo", word="ping")
    assert asyncio.run(env.reset(env.sample_task(random.Random(0)))) == "Say ping."
    assert asyncio.run(env.step("ping")).reward == 1.0
    # its topic's name: characters a topic can carry
    assert env_name("tests.user_env:Echo") == "tests.user_env-Echo"
    with pytest.raises(InvalidConfigError, match="not a subclass"):
        make("tests.user_env:NOT_AN_ENVIRONMENT")
    with pytest.raises(InvalidConfigError, match="cannot load"):
        make("tests.no_such_module:Echo")
    with pytest.raises(InvalidConfigError, match=r"package\.module:Class"):
        make("nothing-like-it")


def test_a_missing_ecosystem_package_is_one_sentence_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    missing = Adapter("elsewhere", "x:Y", "no_such_package_rlstream", "envs", "")
    monkeypatch.setitem(base.ADAPTERS, "elsewhere", missing)
    with pytest.raises(InvalidConfigError) as e:
        make("elsewhere:thing")
    assert "pip install 'rlstream[envs]'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(InvalidConfigError, match="needs a name"):
        make("reasoning-gym:")


def _play(env: base.Environment, task: base.Task, answers: list[str]) -> tuple[str, float, int]:
    async def go() -> tuple[str, float, int]:
        prompt = await env.reset(task)
        total, turns = 0.0, 0
        for a in answers:
            step = await env.step(a)
            total, turns = total + step.reward, turns + 1
            if step.done:
                break
        return prompt, total, turns

    return asyncio.run(go())


def test_reasoning_gym_scores_with_the_datasets_own_answer_check() -> None:
    import reasoning_gym

    env = make("reasoning-gym:basic_arithmetic")
    assert env.name == env_name("reasoning-gym:basic_arithmetic")
    assert env.name == "reasoning-gym-basic_arithmetic"
    task = env.sample_task(random.Random(1))
    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=task.params["seed"])[0]
    right, wrong = entry["answer"], "no idea"
    prompt, reward, turns = _play(env, task, [f"so <answer>{right}</answer>"])
    assert prompt == entry["question"] and (reward, turns) == (1.0, 1)
    assert _play(env, task, [wrong])[1:] == (0.0, 1)
    # a second try after feedback: the last answer's score is the reward
    two = make("reasoning-gym:basic_arithmetic", attempts=2)
    assert _play(two, task, [wrong, right])[1:] == (1.0, 2)
    assert _play(two, task, [wrong, wrong, right])[1:] == (0.0, 2)


def test_reasoning_gym_success_is_solving_not_partial_credit() -> None:
    from pipeline.records.trajectory import SOLVED, succeeded

    env = make("reasoning-gym:basic_arithmetic", min_terms=2, max_terms=2)
    task = env.sample_task(random.Random(5))
    answer = _answer_of(task, min_terms=2, max_terms=2)

    async def last_step(text: str) -> base.Step:
        await env.reset(task)
        return await env.step(text)

    # an answer that contains the right one earns partial credit (its length's share):
    # a positive reward, not a success
    wrong = asyncio.run(last_step(f"{answer} or 99"))
    assert 0 < wrong.reward < 1 and wrong.info["rewards"] == {SOLVED: 0.0}
    assert not succeeded(wrong.reward, wrong.info["rewards"])
    right = asyncio.run(last_step(answer))
    assert right.reward == 1.0 and succeeded(right.reward, right.info["rewards"])
    # environments that report no `solved` count a positive reward, as before
    assert succeeded(0.5, {}) and not succeeded(0.0, {"env": 0.0})


def _answer_of(task: base.Task, **config: int) -> str:
    import reasoning_gym

    entry = reasoning_gym.create_dataset(
        "basic_arithmetic", size=1, seed=task.params["seed"], **config
    )[0]
    return str(entry["answer"])


def test_reasoning_gym_baseline_is_the_best_an_agent_ignoring_the_question_does() -> None:
    import collections

    import reasoning_gym

    # letter counting's answers are small counts, mostly 1: always answering the most
    # common answer beats answering with another question's answer, and is the baseline
    options = {"min_words": 3, "max_words": 3}
    rate = make("reasoning-gym:letter_counting", **options).random_success()
    data = reasoning_gym.create_dataset("letter_counting", size=1000, seed=11, **options)
    answers = [str(data[i]["answer"]) for i in range(1000)]
    common, times = collections.Counter(answers).most_common(1)[0]
    assert common == "1"
    prior = sum(data.score_answer(answers[999 - i], data[i]) >= 1.0 for i in range(500)) / 500
    assert rate is not None and abs(rate - times / 1000) < 0.06 and rate > prior
    # multi-digit arithmetic: almost never right without reading the question
    arith = make("reasoning-gym:basic_arithmetic").random_success()
    assert arith is not None and arith < 0.05


def test_reasoning_gym_tasks_come_from_seeds_and_options_reach_the_dataset() -> None:
    env = make("reasoning-gym:basic_arithmetic", min_terms=2, max_terms=2)
    producer, held_out = random.Random(1), random.Random(1_000_003)
    seen = {env.sample_task(producer).task_id for _ in range(200)}
    assert len(seen) == 200
    assert not seen & {env.sample_task(held_out).task_id for _ in range(200)}
    prompt = asyncio.run(env.reset(env.sample_task(producer)))
    assert prompt.count("+") + prompt.count("-") + prompt.count("*") + prompt.count("/") >= 1
    for bad, why in (
        ({"bogus": 1}, "bogus"),
        ({"attempts": 0}, "attempts"),
        ({"seed": 3}, "seed and size"),
        ({"max_answer_chars": -1}, "max_answer_chars"),
    ):
        with pytest.raises(InvalidConfigError, match=why):
            make("reasoning-gym:basic_arithmetic", **bad)
    with pytest.raises(InvalidConfigError, match="not registered"):
        make("reasoning-gym:no_such_dataset")


def test_reasoning_gym_refuses_hostile_tasks_and_huge_answers() -> None:
    env = make("reasoning-gym:basic_arithmetic", max_answer_chars=64)
    for params in ({}, {"seed": -1}, {"seed": True}, {"seed": 2**40}, {"seed": "7"}):
        with pytest.raises(ValueError, match="no valid seed"):
            asyncio.run(env.reset(base.Task("t", params)))
    task = env.sample_task(random.Random(3))
    # a megabyte of answer is cut before scoring, not scored whole
    assert _play(env, task, ["9" * 1_000_000])[1:] == (0.0, 1)


def test_env_list_shows_the_built_ins_the_ecosystems_and_the_users_own(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.cli.main import main

    monkeypatch.setitem(
        base.ADAPTERS, "elsewhere", Adapter("elsewhere", "x:Y", "no_such_pkg_rl", "more", "far")
    )
    assert main(["env", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert {"guess", "calc", "gym", "http", "process"} <= set(out)
    rg = next(line for line in out if line.startswith("reasoning-gym:"))
    assert "needs" not in rg  # installed here
    far = next(line for line in out if line.startswith("elsewhere:"))
    assert "pip install 'rlstream[more]'" in far
    assert any(line.startswith("package.module:Class") for line in out)
    for prefix in ("textarena:", "openenv:", "--tools mcp:"):
        assert any(line.startswith(prefix) and "needs" not in line for line in out), prefix


def _hanoi_moves(n: int, a: str = "A", b: str = "B", c: str = "C") -> list[str]:
    if n == 0:
        return []
    return [*_hanoi_moves(n - 1, a, c, b), f"[{a} {c}]", *_hanoi_moves(n - 1, b, a, c)]


def test_textarena_games_are_played_to_textarenas_own_reward() -> None:
    env = make("textarena:GuessTheNumber-v0")
    assert env.name == env_name("textarena:GuessTheNumber-v0") == "textarena-GuessTheNumber-v0"
    task = env.sample_task(random.Random(2))

    async def bisect() -> tuple[str, list[str], float, int]:
        prompt = await env.reset(task)
        lo, hi, said, turns = 1, 20, [], 0
        while True:
            guess = (lo + hi) // 2
            step = await env.step(f"I say [{guess}]")
            turns += 1
            if step.done:
                return prompt, said, step.reward, turns
            said.append(step.observation)
            assert "[Player]" not in step.observation  # the model's own move is not echoed
            if "higher" in step.observation:
                lo = guess + 1
            else:
                assert "lower" in step.observation, step.observation
                hi = guess - 1

    prompt, said, reward, turns = asyncio.run(bisect())
    assert "Guess The Number" in prompt and reward == 1.0 and turns <= 5
    # the same seed is the same game
    assert asyncio.run(bisect())[1] == said

    hanoi = make("textarena:TowerOfHanoi-v0")
    moves = _hanoi_moves(3)
    assert _play(hanoi, hanoi.sample_task(random.Random(0)), moves)[1:] == (1.0, len(moves))


#: games no test above plays: each must play from its prompt to an end with a finite reward
HELD_OUT = ["Mastermind-v0", "Minesweeper-v0-small", "FrozenLake-v0", "Sudoku-v0-very-easy"]


@pytest.mark.parametrize("game", HELD_OUT)
def test_held_out_textarena_games_play_to_an_end(game: str) -> None:
    env = make(f"textarena:{game}")
    rng = random.Random(game)

    async def play() -> tuple[str, float, int]:
        prompt = await env.reset(env.sample_task(rng))
        for turn in range(1, 200):
            move = (
                "["
                + " ".join(str(rng.randint(0, 6)) for _ in range(rng.choice((1, 2, 3, 4))))
                + "]"
            )
            step = await env.step(
                rng.choice((move, "[up]", "[down]", "[left]", "[right]", "no idea"))
            )
            assert isinstance(step.observation, str) and step.observation
            if step.done:
                return prompt, step.reward, turn
        raise AssertionError(f"{game} did not end in 200 moves")

    prompt, reward, turns = asyncio.run(play())
    assert prompt and math.isfinite(reward) and -1.0 <= reward <= 1.0 and turns >= 1


def test_textarena_refuses_what_it_cannot_play() -> None:
    with pytest.raises(InvalidConfigError, match="textarena:NoSuchGame-v0"):
        make("textarena:NoSuchGame-v0")
    with pytest.raises(InvalidConfigError, match="single-player"):
        make("textarena:TicTacToe-v0")
    with pytest.raises(InvalidConfigError, match="bogus"):
        make("textarena:GuessTheNumber-v0", bogus=1)
    with pytest.raises(InvalidConfigError, match="max_observation_chars"):
        make("textarena:GuessTheNumber-v0", max_observation_chars=0)
    env = make("textarena:GuessTheNumber-v0", max_observation_chars=64)
    for params in ({}, {"seed": -1}, {"seed": True}, {"seed": 2**40}, {"seed": "7"}):
        with pytest.raises(ValueError, match="no valid seed"):
            asyncio.run(env.reset(base.Task("t", params)))
    with pytest.raises(RuntimeError, match="before reset"):
        asyncio.run(make("textarena:GuessTheNumber-v0").step("[3]"))

    async def flood() -> None:
        await env.reset(env.sample_task(random.Random(5)))
        step = await env.step("[" + "9" * 1_000_000 + "]")  # cut, then refused by the game
        assert len(step.observation) <= 64

    asyncio.run(flood())
