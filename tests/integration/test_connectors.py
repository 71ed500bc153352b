"""External environments against real processes: an HTTP server (``rlstream env serve``
and a misbehaving one), child processes speaking JSON lines, a Gymnasium environment;
faults injected on purpose end one episode with a record, never the others."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connectors import stats
from connectors.base import Environment, Task, close_shared, make
from pipeline.policy.tokenizer import ByteTokenizer
from pipeline.records.codec import TrajectoryCodec
from pipeline.records.trajectory import Trajectory
from pipeline.rollout.config import EpisodeLimits
from pipeline.rollout.episode import GroupSlot, run_episode
from pipeline.testing import ScriptedPolicy

ROOT = Path(__file__).resolve().parents[2]
RLSTREAM = [sys.executable, "-m", "pipeline.cli"]
TOK = ByteTokenizer()
LIMITS = EpisodeLimits(max_new_tokens=8, max_policy_turns=8, step_timeout_s=20)


says = ScriptedPolicy.says


async def episode(env: Environment, policy: ScriptedPolicy, task: Task | None = None) -> Trajectory:
    task = task or env.sample_task(__import__("random").Random(0))
    t = await run_episode(
        env,
        GroupSlot("g", 1, 0, task),
        policy,  # type: ignore[arg-type]
        0,
        TOK,
        LIMITS,
        "p",
    )
    TrajectoryCodec().encode(t)  # whatever happened, a valid record
    return t


def observations(t: Trajectory, role: str) -> list[str]:
    return [TOK.decode(t.tokens[u.start : u.end].tolist()) for u in t.turns if u.role == role]


def start(cmd: list[str], pattern: str) -> tuple[subprocess.Popen[str], re.Match[str]]:
    """Start a server process and wait for the line that says where it listens."""
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    m = re.search(pattern, line)
    if m is None:
        p.kill()
        raise AssertionError(f"server said {line!r}")
    return p, m


def stop(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.terminate()
        p.wait(10)


@pytest.fixture
def serve() -> Iterator[Any]:
    procs: list[subprocess.Popen[str]] = []

    def run(*args: str) -> str:
        p, m = start([*RLSTREAM, "env", "serve", *args], r"on (http://\S+)/v1")
        procs.append(p)
        return m.group(1)

    yield run
    for p in procs:
        stop(p)


@pytest.fixture(scope="module")
def faulty() -> Iterator[str]:
    p, m = start([sys.executable, "-m", "tests.connector_faults", "http"], r"port (\d+)")
    yield f"http://127.0.0.1:{m.group(1)}"
    stop(p)


def test_episode_with_tools_against_env_serve_in_another_process(serve: Any) -> None:
    url = serve("calc", "--port", "0")

    async def main() -> Trajectory:
        env = make("http", url=url, name="calc")
        policy = says(
            "<call>calc 6*7", '<call>calc {"expression": 6}', "<call>calc import os", "42"
        )
        try:
            return await episode(
                env, policy, Task("calc-6*7+0", {"expression": "6*7+0", "answer": 42})
            )
        finally:
            await close_shared()

    t = asyncio.run(main())
    assert t.status == "ok" and t.reward == 1.0 and t.env == "calc"
    tools = observations(t, "tool")
    assert tools[0] == "42"
    assert tools[1] == "error: expression: 6 is not of type 'string'"
    assert tools[2].startswith("error: ValueError: not an expression")
    assert observations(t, "user") == ["What is 6*7+0?"]


def test_http_faults_end_their_episode_and_no_other(faulty: str) -> None:
    """Each mode's episode next to a healthy one, all at once."""
    expect = {
        "ok": "ok",
        "flaky": "ok",  # a 503, then a retry succeeds
        "drop": "ok",  # a lost connection, then a retry succeeds
        "html500": "env_error",  # retried, then given up
        "malformed": "env_error",  # not retried
        "oversized": "env_error",
        "nan": "env_error",
        "hang": "timeout",
    }
    stats.reset()

    async def main() -> tuple[dict[str, Trajectory], float]:
        def env(mode: str) -> Environment:
            return make(
                "http",
                url=f"{faulty}/{mode}",
                name="guess",
                call_timeout_s=1.0,
                attempts=3,
                backoff_s=0.05,
            )

        task = Task("secret-5", {"secret": 5})
        t0 = time.monotonic()
        runs = [episode(env(mode), says("3", "5"), task) for mode in expect]
        done = await asyncio.gather(*runs)
        await close_shared()
        return dict(zip(expect, done, strict=True)), time.monotonic() - t0

    got, elapsed = asyncio.run(main())
    assert {m: t.status for m, t in got.items()} == expect
    assert got["ok"].reward == got["flaky"].reward == got["drop"].reward == 1.0
    # every episode still answered for itself: the hung one took its retries' time
    assert elapsed < 10
    c = stats.snapshot()
    assert c["http/http_503"] == 2  # one per step of the flaky episode
    assert c["http/connection"] >= 2 and c["http/retry"] >= 2 + 2 + 2 * 1
    assert c["http/http_500"] == 3  # attempts
    assert c["http/malformed"] == 2  # the malformed body and the NaN reward
    assert c["http/oversized"] == 1
    assert c["http/timeout"] == 3
    assert c["http/gave_up"] == 2  # html500 and hang


def test_server_down_and_back(serve: Any) -> None:
    url = serve("guess", "--port", "0")
    port = int(url.rsplit(":", 1)[1])
    stats.reset()

    async def main() -> tuple[Trajectory, Trajectory]:
        env = make("http", url=url, name="guess", attempts=2, backoff_s=0.05)
        task = Task("secret-5", {"secret": 5})
        prompt = await env.reset(task)
        assert prompt.startswith("Guess my number")
        # the server dies in the middle of the episode
        for line in subprocess.run(
            ["pgrep", "-f", "env serve guess --port 0"], capture_output=True, text=True
        ).stdout.split():
            os.kill(int(line), signal.SIGKILL)
        time.sleep(0.5)
        broken = await episode(
            make("http", url=url, name="guess", attempts=2, backoff_s=0.05), says("5"), task
        )
        # a new server on the same port: the shared pool reconnects
        serve("guess", "--port", str(port))
        healed = await episode(make("http", url=url, name="guess"), says("5"), task)
        await close_shared()
        return broken, healed

    broken, healed = asyncio.run(main())
    assert broken.status == "env_error"
    assert healed.status == "ok" and healed.reward == 1.0
    c = stats.snapshot()
    assert c["http/connection"] >= 2 and c["http/gave_up"] >= 1


def test_served_environment_binds_to_loopback(serve: Any) -> None:
    url = serve("guess", "--port", "0")
    port = int(url.rsplit(":", 1)[1])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":  # LISTEN
                listening.append(addr)
    assert listening == ["0100007F"]  # 127.0.0.1, nothing else


def test_child_process_episode_with_tools() -> None:
    async def main() -> Trajectory:
        env = make("process", command=[*RLSTREAM, "env", "serve", "calc", "--stdio"], name="calc")
        try:
            return await episode(
                env, says("<call>calc 2+2", "4"), Task("c", {"expression": "2+2", "answer": 4})
            )
        finally:
            await close_shared()

    t = asyncio.run(main())
    assert t.status == "ok" and t.reward == 1.0
    assert observations(t, "tool") == ["4"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_child_faults_end_their_episode_and_no_other(tmp_path: Path) -> None:
    expect = {
        "ok": "ok",
        "hang": "timeout",
        "garbage": "env_error",
        "die": "env_error",
        "oversized": "env_error",
        "wrong_id": "env_error",
        "die_first_reset": "ok",  # replaced, and the reset tried again
    }
    os.environ["FAULT_MARK"] = str(tmp_path / "mark")
    stats.reset()

    async def main() -> tuple[dict[str, Trajectory], list[int]]:
        envs = {
            mode: make(
                "process",
                command=[sys.executable, "-m", "tests.connector_faults", "child", mode],
                name="guess",
                call_timeout_s=1.0,
                cwd=str(ROOT),
            )
            for mode in expect
        }
        task = Task("secret-5", {"secret": 5})
        done = await asyncio.gather(*(episode(envs[m], says("5"), task) for m in expect))
        from connectors.base import _SHARED

        pids = [c.proc.pid for pool in _SHARED.values() for c in pool.idle]  # type: ignore[attr-defined]
        await close_shared()
        return dict(zip(expect, done, strict=True)), pids

    try:
        got, idle_pids = asyncio.run(main())
    finally:
        del os.environ["FAULT_MARK"]
    assert {m: t.status for m, t in got.items()} == expect
    assert got["ok"].reward == got["die_first_reset"].reward == 1.0
    c = stats.snapshot()
    assert c["process/hung"] == 1 and c["process/garbage"] == 2  # garbage, wrong_id
    assert c["process/oversized"] == 1 and c["process/restart"] == 1
    assert c["process/died"] == 2  # die, and die_first_reset's first child
    # only the healthy children went back to the pool; the others were killed
    assert len(idle_pids) == 2
    assert not any(_alive(pid) for pid in idle_pids)  # closed with the pool


def test_gymnasium_text_environment() -> None:
    async def main() -> tuple[Trajectory, Trajectory]:
        env = make("gym", id="tests.gym_text_env:GuessText-v0", name="guesstext")
        ok = await episode(env, says(*"12345678"))
        numeric = make(
            "gym", id="tests.gym_text_env:GuessText-v0", kwargs={"numeric_observation": True}
        )
        bad = await episode(numeric, says("1"))
        return ok, bad

    ok, bad = asyncio.run(main())
    assert ok.status == "ok" and ok.reward == 1.0 and ok.env == "guesstext"
    assert observations(ok, "user") == ["Guess my number from 1 to 8."]
    assert set(observations(ok, "environment")) <= {"Higher.", "Lower."}
    assert bad.status == "env_error"


@pytest.mark.integration
def test_producer_against_env_serve_in_another_process(
    serve: Any, bootstrap: str, namespace: str, faulty: str
) -> None:
    """``rlstream produce`` drives a served environment: every episode a record in the
    served environment's topic; then against a flaky server, retries keep it whole."""
    from pipeline.kafka.client import KafkaConfig
    from pipeline.kafka.topics import rollout_topic
    from pipeline.kafka.transport import Decoded, TrajectoryReader

    url = serve("guess", "--port", "0")
    common = [
        *RLSTREAM,
        "produce",
        "--bootstrap",
        bootstrap,
        "--namespace",
        namespace,
        "--env",
        "http",
        "--env-option",
        "name=guess",
        "--max-episodes",
        "32",
        "--concurrency",
        "16",
        "--group-size",
        "4",
        "--max-staleness",
        "-1",
        "--json",
    ]
    runs = []
    for target in (url, f"{faulty}/flaky"):
        out = subprocess.run(
            [*common, "--env-option", f"url={target}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1])["figures"])
    for figures in runs:
        assert figures["episodes"] == 32 and figures["delivered"] == 32
        assert set(figures["by_status"]) <= {"ok", "truncated"}
    assert runs[1]["connectors"]["http/http_503"] >= 1
    assert runs[1]["connectors"]["http/retry"] >= runs[1]["connectors"]["http/http_503"]

    kafka = KafkaConfig(bootstrap=bootstrap)
    reader = TrajectoryReader(kafka, [rollout_topic(namespace, "guess")], f"{namespace}.check")
    got = reader.read(64, timeout=60)
    reader.close()
    assert len(got) == 64 and all(isinstance(r, Decoded) for r in got)
    assert {r.trajectory.env for r in got} == {"guess"}  # type: ignore[union-attr]
