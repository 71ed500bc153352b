"""verifiers environments (``verifiers:MODULE``) against the real verifiers package.

This suite runs in the environment of the ``test-verifiers`` extra (verifiers' classic
API needs ``mcp<2``, the ``envs`` extra ``mcp>=2.3``): ``infra/dev.sh test`` runs it there
after the main suite, with ``RLSTREAM_CLIENT_PYTHON`` set to the main environment's Python
for the test that serves a verifiers environment to a client that has no verifiers.
The environments are written as verifiers' own examples write them (envs/)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connectors.base import Task, make
from pipeline.errors import InvalidConfigError
from pipeline.policy.tokenizer import ByteTokenizer
from pipeline.records.codec import TrajectoryCodec
from pipeline.records.trajectory import Trajectory
from pipeline.rollout.config import EpisodeLimits
from pipeline.rollout.episode import GroupSlot, run_episode
from pipeline.testing import ScriptedPolicy

ROOT = Path(__file__).resolve().parents[2]
ENVS = Path(__file__).resolve().parent / "envs"
TOK = ByteTokenizer()
RLSTREAM = [sys.executable, "-m", "pipeline.cli"]

if str(ENVS) not in sys.path:  # verifiers' load_environment imports the module by name
    sys.path.insert(0, str(ENVS))


def env_vars() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ENVS), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


says = ScriptedPolicy.says


def figures(cmd: list[str]) -> dict[str, Any]:
    """The ``figures`` of an rlstream command's JSON line; it must exit 0."""
    out = subprocess.run(cmd, cwd=ROOT, env=env_vars(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1])["figures"])


def episode(
    name: str, policy: ScriptedPolicy, row: int = 0, step_timeout_s: float = 20, **options: Any
) -> Trajectory:
    async def main() -> Trajectory:
        env = make(name, **options)
        task = Task("t", {"split": "train", "row": row})
        limits = EpisodeLimits(max_new_tokens=64, max_policy_turns=8, step_timeout_s=step_timeout_s)
        t = await run_episode(env, GroupSlot("g", 1, 0, task), policy, 0, TOK, limits, "p")  # type: ignore[arg-type]
        # nothing of the episode is left running (a cancelled rollout, a pending read)
        left = [x for x in asyncio.all_tasks() if x is not asyncio.current_task()]
        assert not left, left
        return t

    t = asyncio.run(main())
    TrajectoryCodec().encode(t)  # whatever happened, a valid record
    return t


def said(t: Trajectory, role: str) -> list[str]:
    return [TOK.decode(t.tokens[u.start : u.end].tolist()) for u in t.turns if u.role == role]


def test_single_turn_multi_turn_and_tool_environments_score_with_their_rubric() -> None:
    # SingleTurnEnv: row 0 is "0 + 0"; the rubric weighs the answer 1 and its brevity 0.1
    t = episode("verifiers:vf_arith", says("0"))
    assert t.status == "ok" and t.env == "verifiers-vf_arith"
    assert t.reward == pytest.approx(1.1)
    assert dict(t.rewards) == {"correct": 1.0, "short": 1.0, "num_turns": 1.0, "env": 1.1}
    assert "You add numbers." in said(t, "user")[0] and "0 + 0" in said(t, "user")[0]
    wrong = episode("verifiers:vf_arith", says("seventeen"))
    assert wrong.reward == 0.0 and wrong.rewards["correct"] == 0.0

    # MultiTurnEnv: the environment's env_response answers each guess until it is right
    t = episode("verifiers:vf_guess", says("5", "3", "1"))  # row 0: the number is 1
    assert t.status == "ok" and t.reward == 1.0
    assert said(t, "environment") == ["No: lower.", "No: lower."]
    assert t.rewards["num_turns"] == 3.0
    # ... and its max_turns ends the episode, scored, however the model answers
    t = episode("verifiers:vf_guess", says("8", "8", "8", "8", "8"), max_turns=2)
    assert t.status == "ok" and t.reward == 0.0 and t.rewards["num_turns"] == 2.0

    # ToolEnv: the model's call runs in the environment (its own tool function), the
    # result is a tool turn, and the rubric sees the calls (its tool-count metrics)
    t = episode("verifiers:vf_calc", says('<call>multiply {"a": 12, "b": 34}', "408"))
    assert t.status == "ok" and t.reward == 1.0
    assert said(t, "tool") == ["408"]
    assert t.rewards["multiply_calls"] == 1.0 and t.rewards["total_tool_calls"] == 1.0
    # a call the tool cannot take is the model's to read, as verifiers formats it
    t = episode("verifiers:vf_calc", says('<call>multiply {"a": 12}', "0"))
    assert t.status == "ok" and "missing 1 required positional argument" in said(t, "tool")[0]
    # a tool the environment does not have never reaches it
    t = episode("verifiers:vf_calc", says('<call>divide {"a": 1}', "0"))
    assert said(t, "tool") == ["error: no tool named 'divide'"]


def test_tools_are_listed_with_the_schemas_verifiers_derives() -> None:
    env = make("verifiers:vf_calc")
    assert env.tools is not None
    (tool,) = env.tools.describe()
    assert tool["name"] == "multiply" and tool["description"] == "Multiply two integers."
    assert tool["parameters"]["required"] == ["a", "b"]
    assert tool["parameters"]["properties"]["a"]["type"] == "integer"
    assert make("verifiers:vf_arith").tools is None


def test_held_out_tasks_come_from_the_eval_dataset_where_there_is_one() -> None:
    arith, guess = make("verifiers:vf_arith"), make("verifiers:vf_guess")
    rng = random.Random(0)
    assert {arith.sample_task(rng).params["split"] for _ in range(20)} == {"train"}
    held = [arith.held_out_task(rng) for _ in range(20)]
    assert {t.params["split"] for t in held} == {"eval"}
    assert all(0 <= t.params["row"] < 10 for t in held)  # the eval dataset's 10 rows
    assert {guess.held_out_task(rng).params["split"] for _ in range(5)} == {"train"}


@pytest.mark.parametrize(
    ("mode", "status"),
    [("nan", "env_error"), ("inf", "env_error"), ("raise", "env_error"), ("image", "env_error")],
)
def test_a_misbehaving_environment_ends_its_episode_with_a_reason(mode: str, status: str) -> None:
    t = episode("verifiers:vf_hostile", says("a", "b", "c"), mode=mode)
    assert t.status == status and t.reward == 0.0
    assert dict(t.rewards) == {"env": 0.0}  # no component of an episode that failed


def test_a_hanging_environment_times_out_and_its_rollout_is_cancelled() -> None:
    t = episode("verifiers:vf_hostile", says("a", "b"), step_timeout_s=1.0, mode="hang")
    assert t.status == "timeout"  # and episode() checked that nothing was left running


def test_a_flooding_environment_is_cut_to_the_bound() -> None:
    from connectors.verifiers import MAX_OBSERVATION_CHARS

    async def main() -> str:
        env = make("verifiers:vf_hostile", mode="flood")
        await env.reset(Task("t", {"split": "train", "row": 0}))
        step = await env.step("a")
        await env.close()
        return step.observation

    observation = asyncio.run(main())
    assert len(observation) <= MAX_OBSERVATION_CHARS + len(" [truncated]")
    assert observation.endswith("[truncated]")


@pytest.mark.parametrize(
    ("name", "options", "says_"),
    [
        ("verifiers:vf_hostile", {"mode": "group"}, "group-level reward functions"),
        ("verifiers:vf_hostile", {"mode": "not_an_env"}, "vf_hostile"),
        ("verifiers:no_such_module_anywhere", {}, "Could not import"),
        ("verifiers:vf_arith", {"no_such_argument": 1}, "no_such_argument"),
        ("verifiers:../etc/passwd", {}, "is not a module name"),
    ],
)
def test_what_cannot_run_is_refused_at_load_in_one_sentence(
    name: str, options: dict[str, Any], says_: str
) -> None:
    with pytest.raises(InvalidConfigError, match=says_) as e:
        make(name, **options)
    assert "\n" not in str(e.value)


def test_a_task_that_names_no_row_is_an_episode_error() -> None:
    async def main() -> None:
        env = make("verifiers:vf_arith")
        for params in ({"split": "train", "row": 10**9}, {"split": "x", "row": 0}, {"row": "0"}):
            with pytest.raises(ValueError, match="row"):
                await env.reset(Task("t", params))
            await env.close()

    asyncio.run(main())


def test_rlstream_eval_runs_a_verifiers_environment() -> None:
    got = figures([*RLSTREAM, "eval", "--env", "verifiers:vf_guess", "--episodes", "8", "--json"])
    assert got["episodes"] == 8 and sum(got["statuses"].values()) == 8
    assert set(got["statuses"]) <= {"ok", "truncated"}


@pytest.fixture
def served() -> Iterator[str]:
    """``rlstream env serve verifiers:vf_calc`` in this (the verifiers) environment."""
    p = subprocess.Popen(
        [*RLSTREAM, "env", "serve", "verifiers:vf_calc", "--port", "0"],
        cwd=ROOT,
        env=env_vars(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    assert " on http://" in line, line
    yield line.split(" on ", 1)[1].split("/v1")[0]
    p.terminate()
    p.wait(10)


def test_a_served_verifiers_environment_plays_for_a_client_without_verifiers(served: str) -> None:
    client = os.environ.get("RLSTREAM_CLIENT_PYTHON", sys.executable)
    if client != sys.executable:  # the main environment: verifiers is not there at all
        probe = subprocess.run([client, "-c", "import verifiers"], capture_output=True)
        assert probe.returncode != 0
    got = figures(
        [
            *(client, "-m", "pipeline.cli", "eval", "--env", "http"),
            *("--env-option", f"url={served}", "--env-option", "name=verifiers-vf_calc"),
            *("--episodes", "4", "--json"),
        ]
    )
    assert got["episodes"] == 4 and set(got["statuses"]) <= {"ok", "truncated"}


@pytest.mark.integration
def test_a_producer_writes_the_rubrics_components_into_each_record(
    bootstrap: str, namespace: str
) -> None:
    from pipeline.kafka.client import KafkaConfig
    from pipeline.kafka.topics import rollout_topic
    from pipeline.kafka.transport import Decoded, TrajectoryReader

    produced = figures(
        [
            *(*RLSTREAM, "produce", "--bootstrap", bootstrap, "--namespace", namespace),
            *("--env", "verifiers:vf_arith", "--max-episodes", "16", "--concurrency", "8"),
            *("--group-size", "4", "--max-staleness", "-1", "--json"),
        ]
    )
    assert produced["delivered"] == 16
    reader = TrajectoryReader(
        KafkaConfig(bootstrap=bootstrap),
        [rollout_topic(namespace, "verifiers-vf_arith")],
        f"{namespace}.check",
    )
    got = reader.read(16, timeout=60)
    reader.close()
    assert len(got) == 16 and all(isinstance(r, Decoded) for r in got)
    for r in got:
        t = r.trajectory  # type: ignore[union-attr]
        if t.status == "ok":
            assert {"correct", "short", "num_turns", "env"} <= set(t.rewards)
            assert t.reward == pytest.approx(t.rewards["correct"] + 0.1 * t.rewards["short"])
