"""The trainer group as one JAX job: two processes of two devices train the numbers one
device does, from one recording, and a checkpoint holds every member's share.

The processes are real ``rlstream train`` processes joined by ``jax.distributed`` (gloo
collectives on CPU); no broker is needed, as they train from a recording."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import fastavro
import jax
import numpy as np
import pytest
from flax import nnx

from pipeline.errors import InvalidConfigError
from pipeline.kafka.replay import RecordingSource, recording_schema
from pipeline.policy.checkpoint import restore_params
from pipeline.policy.config import ModelConfig
from pipeline.policy.model import init_model
from pipeline.policy.tokenizer import TOKENIZER_ID
from pipeline.records.codec import to_avro_dict
from pipeline.testing import make_trajectory
from pipeline.train.config import TrainerConfig
from pipeline.train.members import STALLED_EXIT, free_coordinator

STEPS, GROUPS, SIZE = 10, 4, 4


def _recording(path: Path, steps: int = STEPS) -> None:
    """``steps`` batches of ``GROUPS`` groups of ``SIZE``, of 24 to 60 tokens each, with
    rewards that differ within every group."""
    rng = np.random.default_rng(0)
    rows = []
    for b in range(steps * GROUPS):
        for i in range(SIZE):
            t = make_trajectory(
                int(rng.integers(24, 60)),
                rng=rng,
                group_id=f"g{b}",
                group_size=SIZE,
                group_index=i,
                turns=2,
                reward=float(rng.random()),
                tokenizer_id=TOKENIZER_ID,
            )
            rows.append(
                {
                    "topic": "ns.rollouts.synthetic",
                    "partition": 0,
                    "offset": len(rows),
                    "timestamp_ms": 1000 + len(rows),
                    "key": f"g{b}".encode(),
                    "headers": {},
                    "trajectory": to_avro_dict(t),
                    "raw": None,
                    "error": None,
                }
            )
    with path.open("wb") as f:
        fastavro.writer(f, recording_schema(), rows, codec="deflate")


def _command(recording: Path, run_dir: Path, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pipeline.cli",
        "train",
        "--from-file",
        str(recording),
        "--run-dir",
        str(run_dir),
        "--groups-per-batch",
        str(GROUPS),
        "--group-size",
        str(SIZE),
        "--buckets",
        "64",
        "--max-staleness",
        "1000",
        "--max-steps",
        str(STEPS),
        "--publish-every",
        "5",
        "--json",
        *flags,
    ]


def _train(recording: Path, run_dir: Path, devices: int, *flags: str) -> subprocess.Popen[str]:
    cmd = _command(recording, run_dir, *flags)
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out


def _params(path: Path) -> list[np.ndarray]:
    return [
        np.asarray(x)
        for x in jax.tree.leaves(nnx.to_pure_dict(restore_params(path, ModelConfig())))
    ]


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def _trained(ledger: Path) -> list[str]:
    return [
        t[0]
        for line in ledger.read_text().splitlines()
        for t in json.loads(line).get("trained", [])
    ]


def test_one_device_four_devices_and_two_processes_of_two_train_the_same_numbers(
    tmp_path: Path,
) -> None:
    """10 steps from one recording: 1 process x 1 device, 1 x 4 and 2 x 2 (a
    ``jax.distributed`` job) end within 1e-5 of each other, every trajectory trained
    once by exactly one member, and the group's checkpoint holds both members' ledgers."""
    rec = tmp_path / "rec.avro"
    _recording(rec)
    one = _train(rec, tmp_path / "1x1", 1)
    _finish(one)
    four = _train(rec, tmp_path / "1x4", 4, "--fsdp", "4")
    _finish(four)
    group = ["--members", "2", "--coordinator", free_coordinator(), "--fsdp", "4"]
    members = [_train(rec, tmp_path / "2x2", 2, *group, "--member-index", str(i)) for i in range(2)]
    outs = [_finish(p) for p in members]
    for out in outs:
        assert json.loads(out.strip().splitlines()[-1])["figures"]["steps"] == STEPS

    reference = _params(tmp_path / "1x1" / "weights" / "v10")
    initial = [
        np.asarray(x)
        for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(init_model(ModelConfig()), nnx.Param)))
    ]
    assert _max_diff(reference, initial) > 1e-3  # the steps moved the parameters
    assert _max_diff(_params(tmp_path / "1x4" / "weights" / "v10"), reference) <= 1e-5
    assert _max_diff(_params(tmp_path / "2x2" / "weights" / "v10"), reference) <= 1e-5

    # each member trained its half of every batch; together, what one trainer trained
    first = _trained(tmp_path / "2x2" / "ledger.jsonl")
    second = _trained(tmp_path / "2x2" / "members" / "1" / "ledger.jsonl")
    assert len(first) == len(second) == STEPS * GROUPS * SIZE // 2
    assert sorted(first + second) == sorted(_trained(tmp_path / "1x1" / "ledger.jsonl"))

    # one checkpoint per publish, with both members' ledger lines and positions
    saved = sorted(int(p.name) for p in (tmp_path / "2x2" / "checkpoints").iterdir())
    assert saved == [5, 10]  # published at steps 5 and 10 (numbered by ledger line)
    meta = json.loads((tmp_path / "2x2" / "checkpoints" / "10" / "meta" / "metadata").read_text())
    assert [m["seq"] for m in meta["members"]] == [10, 10]
    # each past its last record: member 0's share ends with groups 36-37 (offsets to 151)
    lows = [m["positions"]["ns.rollouts.synthetic:0"]["low"] for m in meta["members"]]
    assert lows == [152, 160]

    # a checkpoint of a group of two is not taken up by one trainer alone
    alone = _train(rec, tmp_path / "2x2", 1)
    out, err = alone.communicate(timeout=300)
    assert alone.returncode != 0
    assert "written by a trainer group of 2 member(s): restart it with members=2" in err + out


def test_a_recording_splits_into_whole_groups_in_batch_blocks(tmp_path: Path) -> None:
    rec = tmp_path / "rec.avro"
    _recording(rec, steps=2)
    shares = [RecordingSource(rec, i, 2, GROUPS) for i in range(2)]
    groups = [[(m.key or b"").decode() for m in s.consume(1000)] for s in shares]
    # of each batch of 4 groups, member 0 takes the first two and member 1 the others
    assert sorted(set(groups[0])) == ["g0", "g1", "g4", "g5"]
    assert sorted(set(groups[1])) == ["g2", "g3", "g6", "g7"]
    assert all(groups[0].count(g) == SIZE for g in set(groups[0]))


def test_a_group_that_cannot_split_its_batch_evenly_is_refused() -> None:
    with pytest.raises(InvalidConfigError, match="do not split evenly over 3 trainer members"):
        TrainerConfig(members=3, groups_per_batch=8)
    with pytest.raises(InvalidConfigError, match=r"member_index must be in 0\.\.members-1"):
        TrainerConfig(members=2, member_index=2)
    with pytest.raises(InvalidConfigError, match="coordinator must be host:port"):
        TrainerConfig(members=2, coordinator="localhost")


def test_ledger_lines_of_a_start_that_died_before_its_first_checkpoint_are_redone(
    tmp_path: Path,
) -> None:
    """The ledger line is durable before the checkpoint: a trainer killed between the two,
    on its very first checkpoint, leaves a line that no checkpoint covers. The next start
    removes it (that work is done again) instead of counting it twice."""
    rec = tmp_path / "rec.avro"
    _recording(rec, steps=2)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ghost = {"seq": 1, "step": 1, "version": 1, "trained": [["ghost", "t", 0, 0]], "dropped": []}
    (run_dir / "ledger.jsonl").write_text(json.dumps(ghost) + "\n")
    proc = subprocess.run(
        _command(rec, run_dir), capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    trained = _trained(run_dir / "ledger.jsonl")
    assert "ghost" not in trained and len(trained) == len(set(trained)) == 2 * GROUPS * SIZE


_FINITE_CHECK = """
import sys
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from pipeline.policy.model import all_finite
from pipeline.train.members import Members

members = Members(2, int(sys.argv[2]), sys.argv[1])
mesh = Mesh(np.array(jax.devices()).reshape(4), ("fsdp",))
sharding = NamedSharding(mesh, P("fsdp"))
def tree(bad):
    leaves = []
    for shape in [(256, 64), (64,), (64, 256), (256, 64), (64, 64), (64,), (64, 64)] * 4:
        x = np.ones(shape, np.float32)
        if bad:
            x[-1] = np.nan  # in the last rows: the shard member 1 holds
        leaves.append(jax.make_array_from_callback(shape, sharding, lambda i, x=x: x[i]))
    return {"w": leaves, "step": np.int32(3)}
print(all_finite(tree(False)), all_finite(tree(True)), flush=True)
"""


def test_a_finiteness_check_over_both_members_shards_answers_on_each(tmp_path: Path) -> None:
    """The checkpoint's finiteness check over parameters sharded across two processes
    answers on both (op by op, 28 leaves' collectives in flight at once hung both members
    forever) and sees a NaN in the rows only the other member holds."""
    script = tmp_path / "check.py"
    script.write_text(_FINITE_CHECK)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    coordinator = free_coordinator()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), coordinator, str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-2000:]
        assert out.splitlines()[-1].split() == ["True", "False"]  # after gloo's lines


def test_a_member_that_stops_answering_ends_the_other_with_a_sentence(tmp_path: Path) -> None:
    """Member 1 is frozen (SIGSTOP) mid-run: member 0, waiting in a collective that will
    never complete, exits by its watchdog (status 75, one sentence) instead of hanging,
    so that ``rlstream run`` restarts the group."""
    rec = tmp_path / "rec.avro"
    _recording(rec, steps=40)
    run_dir = tmp_path / "2x2"
    group = ["--members", "2", "--coordinator", free_coordinator(), "--fsdp", "4"]
    slow = ["--stall-timeout-s", "20", "--step-delay-s", "1", "--publish-every", "1"]
    members = [_train(rec, run_dir, 2, *group, *slow, "--member-index", str(i)) for i in range(2)]
    try:
        deadline = time.monotonic() + 300
        ledger = run_dir / "ledger.jsonl"
        while not (ledger.exists() and ledger.read_text().strip()):  # a step trained
            assert time.monotonic() < deadline and members[0].poll() is None
            time.sleep(0.5)
        members[1].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = members[0].communicate(timeout=120)
        assert members[0].returncode == STALLED_EXIT, err[-3000:]
        waited = re.search(r"trainer member 0 made no progress for (\d+) s", err)
        assert waited and int(waited.group(1)) >= 20, err[-3000:]
        assert time.monotonic() - stopped < 20 + 30  # the timeout, a check's interval, exit
        assert "so that the group restarts from its last checkpoint" in err
    finally:
        members[1].send_signal(signal.SIGCONT)
        for p in members:
            p.kill()
            p.communicate()
