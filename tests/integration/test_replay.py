"""Recordings against the real broker: record, read back with Apache avro, inspect (also
a damaged file and a ledger step), play into another namespace, train from a file twice
with bit-identical results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from confluent_kafka import TopicPartition

from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.replay import RecordingError, RecordingSource, read_recording, record
from pipeline.kafka.topics import ensure_topics, namespace_topics, rollout_topic
from pipeline.policy.checkpoint import restore_params
from pipeline.train.trainer import Trainer
from tests.integration.test_trainer import CFG, produce_groups, trainer_config

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


@pytest.fixture
def recorded(kafka: KafkaConfig, namespace: str, tmp_path: Path) -> tuple[Path, list[str]]:
    """12 groups of 4 trajectories and one poison record, recorded with the CLI."""
    ensure_topics(kafka, namespace_topics(namespace, ["math"], 2))
    ids = produce_groups(kafka, namespace, 12)
    p = kafka.producer()
    p.produce(rollout_topic(namespace, "math"), b"\xc3\x01garbage", b"poison")
    p.flush(10)
    out = tmp_path / "rec.avro"
    result = cli(
        "replay", "record", f"--bootstrap={kafka.bootstrap}", f"--namespace={namespace}",
        "-o", str(out), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.splitlines()[-1])["figures"]
    assert figures["records"] == 49 and figures["undecodable"] == 1
    assert "49/49 records" in result.stderr  # the progress bar's last state
    return out, ids


def test_a_recording_keeps_every_record_with_its_coordinates(
    kafka: KafkaConfig, namespace: str, recorded: tuple[Path, list[str]]
) -> None:
    path, ids = recorded
    records = list(read_recording(path))
    assert sorted(r.trajectory.trajectory_id for r in records if r.trajectory) == sorted(ids)
    poison = [r for r in records if r.trajectory is None]
    assert len(poison) == 1 and poison[0].raw == b"\xc3\x01garbage"
    assert poison[0].key == b"poison" and poison[0].error
    # coordinates are Kafka's: each partition's offsets run 0..n-1 in order
    by_partition: dict[int, list[int]] = {}
    for r in records:
        assert r.topic == rollout_topic(namespace, "math") and r.timestamp_ms > 0
        by_partition.setdefault(r.partition, []).append(r.offset)
    for offsets in by_partition.values():
        assert offsets == list(range(len(offsets)))
    # recording joined no group and committed nothing
    c = kafka.consumer(f"{namespace}.trainer")
    committed = c.committed([TopicPartition(records[0].topic, p) for p in (0, 1)], timeout=10)
    c.close()
    assert all(tp.offset < 0 for tp in committed)


def test_apache_avro_reads_a_recording(recorded: tuple[Path, list[str]]) -> None:
    from avro.datafile import DataFileReader
    from avro.io import DatumReader

    path, ids = recorded
    with DataFileReader(path.open("rb"), DatumReader()) as reader:
        rows = list(reader)
        assert reader.meta["avro.codec"] == b"deflate"
    assert len(rows) == 49
    got = {r["trajectory"]["trajectory_id"] for r in rows if r["trajectory"]}
    assert got == set(ids)
    assert all(r["trajectory"]["tokenizer_id"] for r in rows if r["trajectory"])


def test_bounds_select_an_offset_range(kafka: KafkaConfig, namespace: str, tmp_path: Path) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    produce_groups(kafka, namespace, 5)
    stats = record(kafka, namespace, tmp_path / "r.avro", start=("offset", 4), end=("offset", 12))
    offsets = [r.offset for r in read_recording(tmp_path / "r.avro")]
    assert offsets == list(range(4, 12)) and stats.records == 8


def test_inspect_renders_filters_and_survives_damage(
    recorded: tuple[Path, list[str]], tmp_path: Path
) -> None:
    path, _ = recorded
    shown = cli("replay", "inspect", str(path), "--filter", "min_reward=1", "--json")
    assert shown.returncode == 0, shown.stderr
    out = json.loads(shown.stdout.splitlines()[-1])
    assert out["count"] > 0 and all(r["reward"] >= 1 for r in out["records"])
    assert out["records"][0]["turns"][0]["role"]
    text = cli("replay", "inspect", str(path), "--filter", "decodable=false")
    assert "undecodable" in text.stdout and "1 records shown" in text.stdout

    # a torn copy: the first block(s) still show, then a clear error naming the block
    records = list(read_recording(path))
    torn = tmp_path / "torn.avro"
    data = path.read_bytes()
    torn.write_bytes(data[: len(data) * 2 // 3])
    small = tmp_path / "small-blocks.avro"
    _rewrite_in_small_blocks(path, small)
    data = small.read_bytes()
    small.write_bytes(data[: len(data) * 2 // 3])
    got = []
    with pytest.raises(RecordingError, match=r"block \d+ .*damaged or truncated"):
        for r in read_recording(small):
            got.append(r)
    assert 0 < len(got) < len(records)
    assert [r.offset for r in got] == [r.offset for r in records[: len(got)]]
    shown = cli("replay", "inspect", str(small))
    assert shown.returncode == 2
    assert "block" in shown.stderr and f"{len(got)} records shown" in shown.stdout


def _rewrite_in_small_blocks(src: Path, dst: Path) -> None:
    import fastavro

    with src.open("rb") as f:
        reader = fastavro.reader(f)
        schema = reader.writer_schema
        rows = list(reader)
    with dst.open("wb") as f:
        fastavro.writer(f, schema, rows, codec="deflate", sync_interval=2000)


def test_play_publishes_into_another_namespace(
    kafka: KafkaConfig, recorded: tuple[Path, list[str]], namespace: str
) -> None:
    path, _ = recorded
    target = namespace + "-copy"
    result = cli(
        "replay", "play", str(path), f"--bootstrap={kafka.bootstrap}",
        f"--namespace={target}", "--rate", "500", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    again = Path(str(path) + ".again")
    record(kafka, target, again)
    before = {r.trajectory.trajectory_id if r.trajectory else r.raw for r in read_recording(path)}
    after = {r.trajectory.trajectory_id if r.trajectory else r.raw for r in read_recording(again)}
    assert before == after and len(after) == 49


def test_training_from_a_recording_twice_gives_identical_parameters(
    recorded: tuple[Path, list[str]], namespace: str, tmp_path: Path
) -> None:
    path, ids = recorded
    results = []
    for run in ("a", "b"):
        # (all records are of version 0: a staleness bound would drop the later ones)
        cfg = trainer_config(namespace, tmp_path / run, max_steps=None, seed=3, max_staleness=99)
        trainer = Trainer(cfg, None, source=RecordingSource(path))
        steps = trainer.run()
        assert steps == 6  # 12 groups of 4, 2 groups a batch; the poison dropped
        assert trainer.deadlettered == 1
        ledger = [json.loads(x) for x in (tmp_path / run / "ledger.jsonl").read_text().splitlines()]
        trained = [x[0] for e in ledger for x in e["trained"]]
        assert sorted(trained) == sorted(ids)
        results.append((trained, restore_params(tmp_path / run / "weights" / "v6", CFG)))
    # the ledger answers "what did step 2 train on?", with the recording rendered by it
    shown = cli("replay", "inspect", "--ledger", str(tmp_path / "a"), "--step", "2", "--json")
    assert shown.returncode == 0, shown.stderr
    step2 = json.loads(shown.stdout.splitlines()[-1])
    ledger_a = [json.loads(x) for x in (tmp_path / "a" / "ledger.jsonl").read_text().splitlines()]
    assert [x[0] for x in step2["trained"]] == [
        x[0] for e in ledger_a if e["step"] == 2 for x in e["trained"]
    ]
    assert len(step2["trained"]) == 8
    fates = cli("replay", "inspect", str(path), "--ledger", str(tmp_path / "a"), "--json")
    by_id = {
        r.get("trajectory_id"): r["ledger"]
        for r in json.loads(fates.stdout.splitlines()[-1])["records"]
    }
    assert by_id[step2["trained"][0][0]].startswith("trained at step 2 (trainer version 1")
    assert by_id[None].startswith("dropped at step")  # the poison record, and why
    (trained_a, params_a), (trained_b, params_b) = results
    assert trained_a == trained_b  # the same order
    leaves_a, leaves_b = jax.tree.leaves(params_a), jax.tree.leaves(params_b)
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))  # bit-identical


def test_training_a_recording_on_a_mesh_of_four_devices_matches_one_device(
    recorded: tuple[Path, list[str]], namespace: str, tmp_path: Path
) -> None:
    """The same recording trained by one trainer on one device and by one on a 2x2 mesh
    (fsdp x tensor, four host devices in a child process): the same records in the same
    order, and parameters within 1e-5 after six steps."""
    path, _ = recorded
    one = trainer_config(namespace, tmp_path / "one", max_steps=None, seed=3, max_staleness=99)
    assert Trainer(one, None, source=RecordingSource(path)).run() == 6
    child = f"""
import sys
from pathlib import Path
from pipeline.kafka.replay import RecordingSource
from pipeline.train.trainer import Trainer
from tests.integration.test_trainer import trainer_config
cfg = trainer_config({namespace!r}, Path({str(tmp_path / "mesh")!r}), max_steps=None, seed=3,
                     max_staleness=99, fsdp=2, tensor_parallel=2)
trainer = Trainer(cfg, None, source=RecordingSource(Path({str(path)!r})))
assert len(trainer.mesh.devices.flat) == 4
sys.exit(0 if trainer.run() == 6 else 1)
"""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    out = subprocess.run(
        [sys.executable, "-c", child],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    trained = []
    for run in ("one", "mesh"):
        ledger = (tmp_path / run / "ledger.jsonl").read_text().splitlines()
        trained.append([x[0] for e in map(json.loads, ledger) for x in e["trained"]])
    assert trained[0] == trained[1]
    a = jax.tree.leaves(restore_params(tmp_path / "one" / "weights" / "v6", CFG))
    b = jax.tree.leaves(restore_params(tmp_path / "mesh" / "weights" / "v6", CFG))
    diff = max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b, strict=True)
    )
    assert diff <= 1e-5, diff
