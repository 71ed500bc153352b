"""A trainer group of two processes (one JAX job, one consumer group) on a real broker:
SIGKILLed again and again, restarted as a whole, it trains every record at most once and
loses none; and ``rlstream run --trainers 2`` runs the pipeline with one (training LoRA
adapters over both members)."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import ensure_topics, namespace_topics, rollout_topic
from pipeline.kafka.transport import Decoded, TrajectoryReader
from pipeline.records.ledger import durable_ledger, outcomes, run_ledger
from pipeline.train.members import free_coordinator
from tests.integration.faults import cli, guess_producer, guess_trainer, terminate_as_it_starts
from tests.sockets import listening

EPISODES = 192


def _start_group(common: list[str], run_dir: Path, log: object) -> list[subprocess.Popen[bytes]]:
    coordinator = free_coordinator()
    return [
        subprocess.Popen(
            guess_trainer(
                common,
                run_dir,
                "--buckets",
                "128",
                "--members",
                "2",
                "--member-index",
                str(i),
                "--coordinator",
                coordinator,
                "--fsdp",
                "0",
            ),
            stdout=log,  # type: ignore[arg-type]
            stderr=log,  # type: ignore[arg-type]
        )
        for i in range(2)
    ]


def _stop(group: list[subprocess.Popen[bytes]], sig: int) -> None:
    for p in group:
        if p.poll() is None:
            p.send_signal(sig)
    for p in group:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def _trained_steps(run_dir: Path) -> int:
    ledger = run_dir / "ledger.jsonl"
    return ledger.read_text().count('"trained": [[') if ledger.exists() else 0


def _wait_for_a_step(run_dir: Path, group: list[subprocess.Popen[bytes]]) -> None:
    """Until the group has trained a step since it started (restored, compiled, read)."""
    before = _trained_steps(run_dir)
    deadline = time.monotonic() + 180
    while _trained_steps(run_dir) <= before:
        assert time.monotonic() < deadline and all(p.poll() is None for p in group)
        time.sleep(0.5)


@pytest.mark.timeout(300)
def test_a_member_stopped_while_it_starts_stops_the_group_cleanly(
    bootstrap: str, namespace: str, tmp_path: Path
) -> None:
    """Member 1 gets SIGTERM the moment its process can handle one, long before it has
    joined: it goes on starting, joins, and the group stops together, both exit 0.
    (Killed by that signal, as a process still loading JAX used to be, it left member 0
    waiting five minutes for it to join.)"""
    ensure_topics(KafkaConfig(bootstrap=bootstrap), namespace_topics(namespace, ["guess"], 2))
    with (tmp_path / "trainers.log").open("ab") as log:
        group = _start_group(["--bootstrap", bootstrap, "--namespace", namespace], tmp_path, log)
        try:
            terminate_as_it_starts(group[1])
            codes = [p.wait(180) for p in group]
        finally:
            _stop(group, signal.SIGKILL)
    text = (tmp_path / "trainers.log").read_text(errors="replace")
    assert codes == [0, 0], text[-3000:]
    assert text.count("joined trainer group") == 2, text[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sigkilled_trainer_group_trains_every_record_at_most_once_and_loses_none(
    bootstrap: str, namespace: str, tmp_path: Path
) -> None:
    """Three times: both members train for a while, then one of them is SIGKILLed and the
    other stopped (the group restarts as a whole, as ``rlstream run`` does). Then the
    group finishes the topic. Every produced record is trained or dropped exactly once
    across the two members' ledgers."""
    kafka = KafkaConfig(bootstrap=bootstrap)
    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 4))
    common = ["--bootstrap", bootstrap, "--namespace", namespace]
    producer = subprocess.Popen(
        guess_producer(
            common,
            EPISODES,
            "--max-staleness",
            "3",
            "--trainer-batch",
            "16",
            "--checkpoint-root",
            str(tmp_path),  # it loads the group's weights as they are announced
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    log = (tmp_path / "trainers.log").open("ab")
    rng = random.Random(11)
    kills = 0
    group: list[subprocess.Popen[bytes]] = []
    try:
        for k in range(3):
            group = _start_group(common, tmp_path, log)
            _wait_for_a_step(tmp_path, group)
            if k == 0:  # the coordinator (no authentication) listens on loopback only
                args = [str(a) for a in group[0].args]
                port = int(args[args.index("--coordinator") + 1].rsplit(":", 1)[1])
                bound = [a for a, p in listening() if p == port]
                assert bound and all(a.is_loopback for a in bound), bound
            time.sleep(rng.uniform(0, 6))  # mid-step, mid-checkpoint or between
            victim = group[k % 2]
            victim.send_signal(signal.SIGKILL)
            assert victim.wait(30) == -signal.SIGKILL
            _stop(group, signal.SIGKILL)  # the survivor is stopped with it
            kills += 1
        group = _start_group(common, tmp_path, log)  # the producer waits on it (admission)
        assert producer.wait(400) == 0
        produced = {}
        reader = TrajectoryReader(kafka, [rollout_topic(namespace, "guess")], f"{namespace}.all")
        for r in reader.read(EPISODES, timeout=120):
            assert isinstance(r, Decoded)
            produced[(r.where.topic, r.where.partition, r.where.offset)] = (
                r.trajectory.trajectory_id
            )
        reader.close()
        deadline = time.monotonic() + 300
        # lines a checkpoint covers: a start may remove the others (their work is redone)
        while (
            set(outcomes(durable_ledger(tmp_path))) != set(produced) and time.monotonic() < deadline
        ):
            time.sleep(2)
        group[1].send_signal(signal.SIGTERM)  # one member's stop stops the group
        assert group[0].wait(60) == 0
        assert group[1].wait(60) == 0
    finally:
        for proc in (producer, *group):
            if proc.poll() is None:
                proc.kill()
    entries = run_ledger(tmp_path)
    seen = outcomes(entries)
    missing = set(produced) - set(seen)
    twice = {k: v for k, v in seen.items() if len(v) > 1}
    assert kills == 3
    assert not missing, f"{len(missing)} produced records never trained or dropped"
    assert not twice, f"trained or dropped more than once: {list(twice.items())[:5]}"
    # the producer is held back by admission while the group is down: most records train
    trained = [k for k, v in seen.items() if v == ["trained"]]
    assert len(trained) >= EPISODES // 2
    # both members trained: each read its own partitions
    assert (tmp_path / "members" / "1" / "ledger.jsonl").read_text().count('"trained": [[')
    ids = [t[0] for e in entries for t in e["trained"]]
    assert len(ids) == len(set(ids)) and set(ids) <= set(produced.values())
    print(
        f"{kills} SIGKILLs; {len(produced)} records, each settled once: "
        f"{dict(Counter(v[0] for v in seen.values()))}"
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_run_starts_a_group_of_two_trainers_and_restarts_it_whole(
    bootstrap: str, tmp_path: Path
) -> None:
    """``rlstream run --trainers 2`` training LoRA adapters: member 1 is SIGKILLed once
    its first step is done; the run restarts both members from the checkpoint and
    completes its steps; what the group announced are adapters on one base, which the
    producer loaded through the cluster (``--weights-source cluster``: as a producer on
    another machine, which cannot read the run directory, does)."""
    run_dir = tmp_path / "run"
    cmd = cli(
        "run",
        "--bootstrap",
        bootstrap,
        "--run-dir",
        str(run_dir),
        "--trainers",
        "2",
        "--steps",
        "6",
        "--groups-per-batch",
        "4",
        "--group-size",
        "4",
        "--concurrency",
        "32",
        "--eval-episodes",
        "0",
        "--restarts",
        "1",
        "--lora.rank",
        "4",
        "--weights-source",
        "cluster",
        "--json",
    )
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        ledger = run_dir / "members" / "1" / "ledger.jsonl"
        while not (ledger.exists() and ledger.read_text().strip()):
            assert time.monotonic() < deadline and run.poll() is None, run.stderr
            time.sleep(1)
        pid = next(
            p["pid"]
            for p in json.loads((run_dir / "processes.json").read_text())
            if p["name"] == "trainer-1"
        )
        subprocess.run(["kill", "-KILL", str(pid)], check=True)
        out, err = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, err[-3000:]
    figures = json.loads(out.strip().splitlines()[-1])["figures"]
    assert figures["status"] == "completed"
    assert figures["restarts"] == {"trainer-1": 1}
    assert "restarting the trainer group (1)" in err + out
    steps = [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps[-1] == 6
    seen = outcomes(run_ledger(run_dir))
    assert all(len(v) == 1 for v in seen.values())  # nothing settled twice across the restart
    # the group announced adapters on the one base it saved, and the producer took them
    producer_log = (run_dir / "logs" / "producer-0.log").read_text()
    assert re.search(r"weights base loaded .*from=cluster", producer_log)
    assert "from=directory" not in producer_log
    loaded = [
        int(v) for v in re.findall(r"weights loaded version=(\d+) .*from=cluster", producer_log)
    ]
    assert loaded and max(loaded) >= 1
    meta = json.loads((run_dir / "weights" / f"v{max(loaded)}" / "rlstream.json").read_text())
    assert meta["lora"]["rank"] == 4
    assert meta["base"]["uri"] == str((run_dir / "weights" / "base").absolute())
