"""Telemetry across processes: spans of separate processes line up on one timeline."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

import pytest

from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import ensure_topics, namespace_topics

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 50


def relay(src: IO[str], dst: IO[str]) -> None:
    for line in src:
        dst.write(line)
        dst.flush()
    dst.close()


def test_spans_of_two_processes_keep_their_true_order(
    kafka: KafkaConfig, bootstrap: str, namespace: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 1))
    env = {**os.environ, "RLSTREAM_BOOTSTRAP": bootstrap}

    def player(name: str, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.clock_pingpong", name, namespace, str(ROUNDS), *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )

    a, b = player("ping", "--first"), player("pong")
    assert a.stdin and a.stdout and b.stdin and b.stdout
    relays = [
        threading.Thread(target=relay, args=(a.stdout, b.stdin)),
        threading.Thread(target=relay, args=(b.stdout, a.stdin)),
    ]
    for t in relays:
        t.start()
    assert a.wait(120) == 0 and b.wait(120) == 0
    for t in relays:
        t.join(10)

    trace = tmp_path / "trace.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "profile",
            f"--namespace={namespace}",
            f"--bootstrap={bootstrap}",
            f"--output={trace}",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    pids = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(pids.values()) == ["ping", "pong"]
    turns = sorted(
        (e for e in events if e["ph"] == "X" and e["name"] == "turn"), key=lambda e: e["ts"]
    )
    assert len(turns) == 2 * ROUNDS
    # on the merged timeline the turns alternate ping, pong, ping ... in round order, and
    # each ends before the next one starts
    expected = [(who, r) for r in range(ROUNDS) for who in ("ping", "pong")]
    assert [(pids[e["pid"]], int(e["args"]["round"])) for e in turns] == expected
    for before, after in itertools.pairwise(turns):
        assert before["ts"] + before["dur"] <= after["ts"]
