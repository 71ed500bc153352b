"""The trainer against the real broker: training and its ledger, commits and
announcements in order, the staleness filter, dead letters, and exactly-once across
SIGKILLs."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from confluent_kafka import TopicPartition
from flax import nnx

from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import (
    deadletter_topic,
    ensure_topics,
    namespace_topics,
    rollout_topic,
    weights_topic,
)
from pipeline.kafka.transport import Decoded, TrajectoryReader, TrajectoryWriter
from pipeline.policy.checkpoint import digest
from pipeline.policy.config import ModelConfig
from pipeline.policy.tokenizer import TOKENIZER_ID
from pipeline.records.codec import AvroCodec
from pipeline.records.ledger import durable_ledger, outcomes, read_ledger
from pipeline.records.trajectory import META_TEMPERATURE
from pipeline.testing import group_member, make_trajectory
from pipeline.train.config import GRPOConfig, TrainerConfig
from pipeline.train.trainer import Trainer
from tests.integration.faults import guess_producer, guess_trainer

pytestmark = pytest.mark.integration

CFG = ModelConfig(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=64)


def trainer_config(ns: str, run_dir: Path, **kw: object) -> TrainerConfig:
    base: dict[str, object] = dict(
        namespace=ns,
        run_dir=run_dir,
        groups_per_batch=2,
        group_size=4,
        buckets=(64,),
        model=CFG,
        grpo=GRPOConfig(warmup_steps=1),
        max_staleness=2,
        batch_timeout_s=2.0,
    )
    base.update(kw)
    return TrainerConfig(**base)  # type: ignore[arg-type]


def produce_groups(
    kafka: KafkaConfig, ns: str, groups: int, version: int = 0, seed: int = 0
) -> list[str]:
    writer = TrajectoryWriter(kafka, ns)
    rng = np.random.default_rng(seed)
    ids = []
    for g in range(groups):
        gid = f"g{seed}-{g}-{version}"
        for i in range(4):
            t = group_member(gid, i, rng, versions=(version,), reward=float(rng.random() < 0.5))
            writer.write(t)
            ids.append(t.trajectory_id)
    writer.flush()
    return ids


def announcements(kafka: KafkaConfig, ns: str) -> list[dict[str, Any]]:
    """Every weights announcement on the namespace's topic, in order."""
    codec = AvroCodec("WeightsAnnouncement")
    reader = kafka.consumer(None, **{"enable.partition.eof": True})
    reader.assign([TopicPartition(weights_topic(ns), 0, 0)])
    anns = []
    while True:
        m = reader.poll(5)
        if m is None or m.error() is not None:
            break
        anns.append(codec.decode(m.value()))
    reader.close()
    return anns


@contextmanager
def running(trainer: Trainer) -> Iterator[None]:
    """The trainer runs in a thread for the ``with`` block, and is stopped after it."""
    th = threading.Thread(target=trainer.run, daemon=True)
    th.start()
    try:
        yield
    finally:
        trainer.stop()
        th.join(60)


def wait_until(cond: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.2)


def run_until(trainer: Trainer, cond: Callable[[], bool], timeout: float = 90) -> None:
    with running(trainer):
        wait_until(cond, timeout)
    assert cond(), "the trainer did not get there in time"


def test_trains_commits_and_announces_in_order(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["math"], 2))
    ids = produce_groups(kafka, namespace, 6)
    trainer = Trainer(trainer_config(namespace, tmp_path), kafka)
    run_until(trainer, lambda: trainer.version >= 3)
    entries = read_ledger(tmp_path / "ledger.jsonl")
    trained = [t[0] for e in entries for t in e["trained"]]
    assert sorted(trained) == sorted(ids)
    assert [e["step"] for e in entries] == [1, 2, 3]
    # committed offsets are the checkpoint's positions: everything (24 records) settled
    consumer = kafka.consumer(f"{namespace}.trainer")
    committed = consumer.committed(
        [TopicPartition(rollout_topic(namespace, "math"), p) for p in (0, 1)], timeout=10
    )
    consumer.close()
    assert sum(tp.offset for tp in committed) == 24
    # the last announcement names a durable checkpoint whose digest matches
    anns = announcements(kafka, namespace)
    assert [a["policy_version"] for a in anns] == [1, 2, 3]
    last = anns[-1]
    assert last["digest"] == digest(Path(last["checkpoint_uri"]))
    metrics = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 3


def test_stale_records_are_dropped_before_decoding(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    produce_groups(kafka, namespace, 6, seed=1)
    trainer = Trainer(trainer_config(namespace, tmp_path, max_staleness=5), kafka)
    run_until(trainer, lambda: trainer.version >= 3)
    stale_ids = produce_groups(kafka, namespace, 2, version=0, seed=2)  # 3 versions old
    fresh_ids = produce_groups(kafka, namespace, 2, version=3, seed=3)
    trainer = Trainer(trainer_config(namespace, tmp_path, max_staleness=1), kafka)
    run_until(trainer, lambda: trainer.version >= 4)
    entries = read_ledger(tmp_path / "ledger.jsonl")
    dropped = [d for e in entries for d in e["dropped"]]
    assert len(dropped) == len(stale_ids) and {d[4] for d in dropped} == {"stale"}
    assert all(d[0] is None for d in dropped)  # decided from headers, never decoded
    trained = {t[0] for e in entries for t in e["trained"]}
    assert set(fresh_ids) <= trained and not set(stale_ids) & trained


def test_bad_records_go_to_the_dead_letter_topic(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    p = kafka.producer()
    topic = rollout_topic(namespace, "math")
    poison = [b"garbage", b"\xc3\x01" + b"\x00" * 8 + b"x", b""]
    for v in poison:
        p.produce(topic, v, b"k")
    other = make_trajectory(20, env="math", group_id="z", group_size=4, tokenizer_id="gpt2")
    from pipeline.records.codec import TrajectoryCodec

    p.produce(topic, TrajectoryCodec().encode(other), b"z")
    hot = make_trajectory(
        20, env="math", group_id="h", group_size=4, turns=2, tokenizer_id=TOKENIZER_ID
    )
    hot.metadata = {META_TEMPERATURE: "1.3"}  # sampled hotter than the trainer scores
    p.produce(topic, TrajectoryCodec().encode(hot), b"h")
    p.flush()
    ids = produce_groups(kafka, namespace, 2, seed=4)
    trainer = Trainer(trainer_config(namespace, tmp_path), kafka)
    run_until(trainer, lambda: trainer.version >= 1 and trainer.deadlettered >= 5)
    consumer = kafka.consumer(f"{namespace}.dl")
    consumer.subscribe([deadletter_topic(namespace)])
    codec = AvroCodec("DeadLetter")
    letters = []
    deadline = time.monotonic() + 30
    while len(letters) < 5 and time.monotonic() < deadline:
        m = consumer.poll(0.5)
        if m is not None and m.error() is None:
            letters.append(codec.decode(m.value()))
    consumer.close()
    assert sorted(d["error_class"] for d in letters) == sorted(
        ["bad_marker", "unknown_schema", "bad_marker", "tokenizer", "temperature"]
    )
    assert {d["value"] for d in letters} >= {b"garbage"}
    assert all(d["source_topic"] == topic for d in letters)
    trained = {t[0] for e in read_ledger(tmp_path / "ledger.jsonl") for t in e["trained"]}
    assert set(ids) <= trained


@pytest.mark.slow
def test_sigkilled_trainer_trains_every_trajectory_at_most_once_and_loses_none(
    bootstrap: str, namespace: str, tmp_path: Path
) -> None:
    kafka = KafkaConfig(bootstrap=bootstrap)
    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 2))
    common = ["--bootstrap", bootstrap, "--namespace", namespace]
    producer = subprocess.Popen(
        guess_producer(common, 480, "--max-staleness", "-1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    train = guess_trainer(common, tmp_path)
    log = (tmp_path / "trainer.log").open("ab")
    rng = random.Random(7)
    kills = 0
    try:
        for _ in range(3):
            trainer = subprocess.Popen(train, stdout=log, stderr=log)
            time.sleep(rng.uniform(8, 16))
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(30)
            kills += 1
        assert producer.wait(300) == 0
        log.flush()
        started_at = (tmp_path / "trainer.log").stat().st_size
        trainer = subprocess.Popen(train, stdout=log, stderr=log)
        produced = {}
        reader = TrajectoryReader(kafka, [rollout_topic(namespace, "guess")], f"{namespace}.all")
        for r in reader.read(480, timeout=120):
            assert isinstance(r, Decoded)
            produced[(r.where.topic, r.where.partition, r.where.offset)] = (
                r.trajectory.trajectory_id
            )
        reader.close()

        def accounted() -> dict[tuple[str, int, int], list[str]]:
            # lines a checkpoint covers: the next start removes the others (a trainer
            # killed mid-checkpoint leaves one) and does their work again
            return outcomes(durable_ledger(tmp_path))

        deadline = time.monotonic() + 240
        while set(accounted()) != set(produced) and time.monotonic() < deadline:
            time.sleep(2)
        # the last trainer has written its first line, so its stop handler is installed
        # (the first thing it does): if the others trained everything, SIGTERM must not
        # find it still loading
        while (tmp_path / "trainer.log").stat().st_size == started_at:
            assert time.monotonic() < deadline + 60, "the last trainer wrote nothing"
            time.sleep(0.5)
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(60) == 0
    finally:
        for proc in (producer, trainer):
            if proc.poll() is None:
                proc.kill()
    seen = accounted()
    missing = set(produced) - set(seen)
    twice = {k: v for k, v in seen.items() if len(v) > 1}
    assert kills == 3
    assert not missing, f"{len(missing)} produced trajectories never trained or dropped"
    assert not twice, f"trained or dropped more than once: {list(twice.items())[:5]}"
    assert set(seen) == set(produced)
    # the producer never reloads weights here, so most records end up too stale: the
    # accounting is what is under test, across trains and every kind of drop
    trained = [k for k, v in seen.items() if v == ["trained"]]
    assert len(trained) >= 64
    reasons = {v[0] for v in seen.values()}
    assert reasons <= {"trained", "stale", "stale_range", "incomplete_group"}
    print(
        f"{kills} SIGKILLs; {len(produced)} records, each settled once: "
        f"{dict(Counter(v[0] for v in seen.values()))}"
    )
    # nothing staler than max_staleness (3) was trained, even after waiting in a buffer
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        assert max(int(s) for s in json.loads(line)["staleness_hist"]) <= 3
    # the trained ids really are the produced ones, each once
    entries = read_ledger(tmp_path / "ledger.jsonl")
    ids = [t[0] for e in entries for t in e["trained"]]
    assert len(ids) == len(set(ids)) and set(ids) <= set(produced.values())


def test_a_certainly_stale_range_is_skipped_with_one_seek(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    produce_groups(kafka, namespace, 4, seed=5)
    trainer = Trainer(trainer_config(namespace, tmp_path, max_staleness=1), kafka)
    run_until(trainer, lambda: trainer.version >= 2)  # versions 1 and 2 announced
    backlog = produce_groups(kafka, namespace, 50, version=0, seed=6)  # 200 records
    time.sleep(1.0)
    trainer = Trainer(trainer_config(namespace, tmp_path, max_staleness=1), kafka)
    trainer.version_times[trainer.version - 1] = int(time.time() * 1000)  # announced "now"
    run_until(
        trainer,
        lambda: trainer.drops.get("stale_range", 0) > 0 and trainer.tracker.pending_count() == 0,
        timeout=60,
    )
    entries = read_ledger(tmp_path / "ledger.jsonl")
    ranges = [d for e in entries for d in e["dropped"] if d[4] == "stale_range"]
    assert ranges and all(isinstance(d[3], list) for d in ranges)
    covered = sum(d[3][1] - d[3][0] for d in ranges)
    one_by_one = [d for e in entries for d in e["dropped"] if d[4] == "stale"]
    assert covered + len(one_by_one) == len(backlog)
    assert covered > len(backlog) // 2


def _status_kb(field: str) -> int:
    """A ``/proc/self/status`` figure, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


@pytest.mark.slow
def test_memory_stays_flat_under_a_flood_of_bad_and_stale_records(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    import tracemalloc

    ensure_topics(kafka, namespace_topics(namespace, ["math"], 2))
    produce_groups(kafka, namespace, 4, seed=8)
    trainer = Trainer(trainer_config(namespace, tmp_path, max_staleness=5), kafka)
    run_until(trainer, lambda: trainer.version >= 2)
    # the flood: 4,000 stale trajectories (9 KB each) and 4,000 records of random bytes
    writer = TrajectoryWriter(kafka, namespace)
    rng = np.random.default_rng(9)
    stale = make_trajectory(
        1000, rng=rng, env="math", group_size=4, versions=(0,), tokenizer_id=TOKENIZER_ID
    )
    value, headers = writer.codec.encode(stale), writer.codec.headers(stale)
    for i in range(4000):
        writer.write_encoded("math", f"s{i}", value, headers)
    p = kafka.producer()
    topic = rollout_topic(namespace, "math")
    for i in range(4000):
        p.produce(topic, rng.bytes(9000), f"p{i}".encode())
        if i % 500 == 0:
            p.poll(0)
    writer.flush()
    p.flush()
    flood_bytes = 8000 * 9000
    trainer = Trainer(trainer_config(namespace, tmp_path, max_staleness=0), kafka)
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    with running(trainer):
        # the process's resident memory too (librdkafka's fetch queue and numpy buffers
        # are outside the Python heap), from the first 500 records on: the trainer's start
        # (compiling its step, filling its fetch queue) is not the flood's doing
        wait_until(lambda: sum(trainer.drops.values()) >= 500, 180)
        base_rss = _status_kb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the peak starts again here
        wait_until(lambda: sum(trainer.drops.values()) >= 8000, 180)
        peak_rss = _status_kb("VmHWM")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert trainer.deadlettered == 4000
    assert trainer.drops["stale"] == 4000
    grown, grown_rss = peak - base, (peak_rss - base_rss) * 1024
    print(
        f"flood={flood_bytes / 1e6:.0f}MB python_peak_growth={grown / 1e6:.1f}MB "
        f"rss_peak_growth={grown_rss / 1e6:.1f}MB"
    )
    assert grown < flood_bytes / 4, f"trainer held {grown / 1e6:.0f} MB of a 72 MB flood"
    # resident: the rest of the flood (65 MB) passed without the process growing by it
    assert grown_rss < flood_bytes / 4, f"the process grew by {grown_rss / 1e6:.0f} MB"


def test_dynamic_sampling_drops_groups_without_signal_and_says_so(
    bootstrap: str, namespace: str, tmp_path: Path
) -> None:
    """With DAPO's dynamic sampling, a group whose rewards are all equal is never trained:
    its members are settled as zero_variance in the ledger; every other group trains."""
    from pipeline.kafka.replay import read_namespace

    kafka = KafkaConfig(bootstrap=bootstrap)
    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    produce_groups(kafka, namespace, 16, seed=5)
    rewards: dict[str, list[float]] = {}
    for r in read_namespace(kafka, namespace, ["math"]):
        assert r.trajectory is not None
        rewards.setdefault(r.trajectory.group_id, []).append(r.trajectory.reward)
    flat = {g for g, rs in rewards.items() if len(set(rs)) == 1}
    assert 0 < len(flat) < 16
    steps = (16 - len(flat)) // 2
    cfg = trainer_config(  # (all records are of version 0: no staleness bound)
        namespace,
        tmp_path,
        max_steps=steps,
        max_staleness=99,
        grpo=GRPOConfig(warmup_steps=1, dynamic_sampling=True),
    )
    assert Trainer(cfg, kafka).run() == steps
    entries = read_ledger(tmp_path / "ledger.jsonl")
    dropped = [d for e in entries for d in e["dropped"] if d[4] == "zero_variance"]
    by_id = {
        r.trajectory.trajectory_id: r.trajectory.group_id
        for r in read_namespace(kafka, namespace, ["math"])
        if r.trajectory is not None
    }
    assert dropped and {by_id[d[0]] for d in dropped} <= flat
    trained = {by_id[t[0]] for e in entries for t in e["trained"]}
    assert len(trained) == 2 * steps and not trained & flat


def test_a_trainer_fenced_out_of_its_group_reads_on_with_a_new_consumer(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    """A consumer with the trainer's static instance id joins the group: Kafka fences the
    trainer's consumer for good (a fatal error, as after some broker restarts). The
    trainer replaces it and trains everything exactly once."""
    ensure_topics(kafka, namespace_topics(namespace, ["math"], 2))
    ids = produce_groups(kafka, namespace, 4)
    trainer = Trainer(trainer_config(namespace, tmp_path, max_staleness=100), kafka)
    with running(trainer):
        wait_until(lambda: trainer.version >= 1, 120)
        assert trainer.version >= 1
        intruder = kafka.consumer(
            f"{namespace}.trainer",
            **{"group.instance.id": f"{namespace}.trainer.0", "session.timeout.ms": 30000},
        )
        intruder.subscribe([rollout_topic(namespace, "math")])
        deadline = time.monotonic() + 60
        while trainer.consumer_renewals == 0 and time.monotonic() < deadline:
            intruder.poll(0.5)
        intruder.close()
        assert trainer.consumer_renewals >= 1, "the trainer's consumer was never fenced"
        ids += produce_groups(kafka, namespace, 4, seed=1)
        wait_until(lambda: trainer.trained >= len(ids), 120)
    trained = [t[0] for e in read_ledger(tmp_path / "ledger.jsonl") for t in e["trained"]]
    assert sorted(trained) == sorted(ids)  # each once, none lost


def test_partitions_revoked_and_assigned_again_are_read_from_the_trainers_own_positions(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    """A rebalance takes the trainer's partitions and gives them back (as after a session
    that timed out while the broker was away), and meanwhile Kafka's committed offset went
    back to 0 (another member of the group committed it). The trainer reads on from its
    own positions: nothing it settled before is read, trained or dropped again."""
    ensure_topics(kafka, namespace_topics(namespace, ["math"], 2))
    ids = produce_groups(kafka, namespace, 8)
    trainer = Trainer(trainer_config(namespace, tmp_path, max_staleness=100), kafka)
    with running(trainer):
        wait_until(lambda: trainer.trained >= len(ids), 120)
        assert trainer.trained == len(ids)
        # a member without a static id: it leaves the group when it closes
        other = kafka.consumer(f"{namespace}.trainer", **{"session.timeout.ms": 10000})
        other.subscribe([rollout_topic(namespace, "math")])
        deadline = time.monotonic() + 60
        while not other.assignment() and time.monotonic() < deadline:
            other.poll(0.5)
        mine = other.assignment()
        assert mine, "the rebalance never gave the other member a partition"
        other.commit(
            offsets=[TopicPartition(tp.topic, tp.partition, 0) for tp in mine],
            asynchronous=False,
        )
        other.close()
        ids += produce_groups(kafka, namespace, 4, seed=1)
        wait_until(lambda: trainer.trained >= len(ids), 120)
    entries = read_ledger(tmp_path / "ledger.jsonl")
    twice = {k: v for k, v in outcomes(entries).items() if len(v) > 1}
    assert not twice, f"settled more than once: {sorted(twice.items())[:5]}"
    trained = [t[0] for e in entries for t in e["trained"]]
    assert sorted(trained) == sorted(ids)  # each once, none lost


def test_a_lora_trainer_trains_and_announces_only_its_adapters(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    from pipeline.policy.checkpoint import restore_params
    from pipeline.policy.config import LoRAConfig
    from pipeline.policy.hf_weights import initial_model
    from pipeline.policy.lora import adapter_meta, restore_adapters, restore_weights

    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    produce_groups(kafka, namespace, 4)
    lora = LoRAConfig(rank=2, alpha=4.0)
    cfg = trainer_config(namespace, tmp_path, lora=lora)
    trainer = Trainer(cfg, kafka)
    run_until(trainer, lambda: trainer.version >= 2)
    anns = announcements(kafka, namespace)
    assert [(a["policy_version"], a["format"]) for a in anns] == [
        (1, "orbax-lora"),
        (2, "orbax-lora"),
    ]
    v2 = Path(anns[-1]["checkpoint_uri"])
    assert anns[-1]["digest"] == digest(v2)
    meta = adapter_meta(v2)
    base = tmp_path / "weights" / "base"
    assert meta == (lora, str(base.absolute()), digest(base))

    def size(p: Path) -> int:
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())

    # v2 holds the adapters alone: rank-2 adapters against every parameter (counted in
    # elements: on this tiny model orbax's metadata, some 12 KB, is most of the bytes)
    initial = jax.tree.map(np.asarray, nnx.state(initial_model(CFG, cfg.seed), nnx.Param))
    stored = sum(np.asarray(x).size for x in jax.tree.leaves(restore_adapters(v2, CFG, lora)))
    assert stored * 3 < sum(x.size for x in jax.tree.leaves(initial))
    assert size(v2) < size(base)
    # the base is the initial policy, untouched; the announced policy moved away from it
    on_disk = restore_params(base, CFG)
    jax.tree.map(np.testing.assert_array_equal, initial, jax.tree.map(np.asarray, on_disk))
    jax.tree.map(
        np.testing.assert_array_equal, initial, jax.tree.map(np.asarray, trainer.state.params)
    )
    policy = restore_weights(v2, CFG)
    moved = max(
        float(np.abs(np.asarray(a) - b).max())
        for a, b in zip(jax.tree.leaves(policy), jax.tree.leaves(initial), strict=True)
    )
    assert moved > 1e-5
