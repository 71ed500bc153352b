"""Records built to break the trainer, through the real broker: each is settled with its
own reason (ledger and dead-letter topic), training goes on, and nothing non-finite is
trained, saved or announced. Also: a trainer whose steps diverge stops with one sentence
and publishes nothing non-finite, and stale-range skipping never trusts producer clocks.
Results in docs/reliability.md."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from confluent_kafka import TopicPartition

from pipeline.errors import TrainingDivergedError
from pipeline.kafka.client import MAX_MESSAGE_BYTES, KafkaConfig
from pipeline.kafka.topics import deadletter_topic, ensure_topics, namespace_topics, rollout_topic
from pipeline.policy.checkpoint import restore_params
from pipeline.policy.model import all_finite
from pipeline.records.codec import HEADER_SIZE, AvroCodec, TrajectoryCodec, to_avro_dict
from pipeline.records.ledger import read_ledger
from pipeline.records.trajectory import Trajectory
from pipeline.testing import group_member
from pipeline.train.config import GRPOConfig
from pipeline.train.intake import DEADLETTER_PREFIX
from pipeline.train.trainer import Trainer
from tests.integration.test_trainer import CFG, produce_groups, run_until, trainer_config

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

CODEC = TrajectoryCodec()


def member(gid: str, index: int, rng: np.random.Generator, **kw: Any) -> Trajectory:
    return group_member(gid, index, rng, **{"reward": float(index % 2), **kw})


def raw(t: Trajectory, change: Callable[[dict[str, Any]], None]) -> bytes:
    """``t``'s record with its plain Avro value changed (bypassing the encoder's checks)."""
    d = copy.deepcopy(to_avro_dict(t))
    change(d)
    return CODEC.encode_avro_dict(d)


def tensor(d: dict[str, Any], name: str, values: np.ndarray) -> None:
    d[name]["data"] = values.tobytes()
    d[name]["shape"] = [len(values)]


def hostile(rng: np.random.Generator, good: bytes) -> dict[str, tuple[list[bytes], set[str]]]:
    """Kinds of hostile record -> (their values, the reasons each may be refused for)."""

    def policy_logprob(value: float) -> Callable[[dict[str, Any]], None]:
        def change(d: dict[str, Any]) -> None:
            lp = np.frombuffer(d["logprobs"]["data"], "<f4").copy()
            mask = np.frombuffer(d["loss_mask"]["data"], "u1")
            lp[np.flatnonzero(mask)[0]] = value
            tensor(d, "logprobs", lp)

        return change

    def token(value: int) -> Callable[[dict[str, Any]], None]:
        def change(d: dict[str, Any]) -> None:
            tokens = np.frombuffer(d["tokens"]["data"], "<i4").copy()
            tokens[5] = value
            tensor(d, "tokens", tokens)

        return change

    def overflow(d: dict[str, Any]) -> None:  # numpy: "array is too big"
        d["tokens"] = {"dtype": "int32", "shape": [2**62, 0], "data": b""}

    def future(d: dict[str, Any]) -> None:
        d["version_spans"] = [dict(s, version=10**12) for s in d["version_spans"]]

    one = lambda i: member(f"h{i}", 0, rng)  # noqa: E731  (a fresh single member)
    huge = good[:HEADER_SIZE] + rng.bytes(MAX_MESSAGE_BYTES - 64 * 1024)
    return {
        "overflow": ([raw(one(1), overflow)], {"tensor_mismatch"}),
        "token_high": ([raw(one(2), token(100_000))], {"token_range"}),
        "token_negative": ([raw(one(3), token(-1))], {"token_range"}),
        "logprob_positive": ([raw(one(4), policy_logprob(5.0))], {"bad_logprob"}),
        "logprob_tiny": ([raw(one(5), policy_logprob(-1e30))], {"bad_logprob"}),
        "reward_huge": (
            [raw(member("h6", i, rng), lambda d: d.update(reward=1e308)) for i in range(4)],
            {"reward_bound"},
        ),
        "component_huge": (
            [raw(one(7), lambda d: d.update(rewards={"env": 1e308, "b": 1e308}))],
            {"reward_bound"},
        ),
        "future": ([raw(one(8), future)], {"future_version"}),
        "nearly_16mib": ([huge], {"bad_length", "truncated", "invalid", "trailing_bytes"}),
    }


def test_hostile_records_are_settled_with_their_reason_and_training_stays_finite(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    topic = rollout_topic(namespace, "math")
    rng = np.random.default_rng(3)
    good = CODEC.encode(member("g", 0, rng))
    kinds = hostile(rng, good)
    p = kafka.producer()
    for kind, (values, _) in kinds.items():
        for i, value in enumerate(values):
            p.produce(topic, value, f"{kind}-{i}".encode())
    # group "dup": member 0 delivered twice; group "twin": one trajectory id at indexes
    # 0 and 3; group "alien": member 2 of another env
    dup = [member("dup", i, rng) for i in range(4)]
    twin = [member("twin", i, rng) for i in range(4)]
    twin[3].trajectory_id = twin[0].trajectory_id
    alien = [member("alien", i, rng, env="other" if i == 2 else "math") for i in range(4)]
    for key, t in [("dup-0", dup[0]), ("dup-again", dup[0])] + [
        (f"{t.group_id}-{t.group_index}", t) for t in dup[1:] + twin + alien
    ]:
        p.produce(topic, CODEC.encode(t), key.encode(), headers=CODEC.headers(t))
    p.flush()
    valid = produce_groups(kafka, namespace, 4, seed=9)
    trainer = Trainer(trainer_config(namespace, tmp_path, group_timeout_s=5.0), kafka)
    expected_letters = sum(len(v) for v, _ in kinds.values()) + 3  # dup, twin, alien repeats

    probe = kafka.consumer(None)
    high = probe.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1]
    probe.close()

    done: list[bool] = []

    def settled() -> bool:  # (latched: a stopped trainer forgets its partitions)
        if not done and trainer.tracker.low((topic, 0)) >= high:  # every record settled
            done.append(trainer.deadlettered >= expected_letters)
        return bool(done) and done[0]

    run_until(trainer, settled, timeout=180)
    entries = read_ledger(tmp_path / "ledger.jsonl")
    trained = [t[0] for e in entries for t in e["trained"]]
    reasons = {d[4] for e in entries for d in e["dropped"]}
    assert set(valid) | {t.trajectory_id for t in dup} <= set(trained)
    assert len(trained) == len(set(trained))  # the repeat of dup-0 was not trained again
    assert not {t.trajectory_id for t in twin + alien} & set(trained)
    assert {"duplicate", "env_mismatch", "incomplete_group"} <= reasons
    # each hostile record is in the dead-letter topic with its reason
    letters = read_letters(kafka, namespace, expected_letters)
    for kind, (values, allowed) in kinds.items():
        for i in range(len(values)):
            assert letters[f"{kind}-{i}"]["error_class"] in allowed, (kind, letters[f"{kind}-{i}"])
    assert letters["dup-again"]["error_class"] == "duplicate"
    assert letters["twin-3"]["error_class"] == "duplicate"
    assert letters["alien-2"]["error_class"] == "env_mismatch"
    big = letters["nearly_16mib-0"]
    assert len(big["value"]) == DEADLETTER_PREFIX
    assert int(big["headers"]["rlstream.value_size"]) == MAX_MESSAGE_BYTES - 64 * 1024 + 10
    assert trainer.deadletter_failures == 0
    # nothing non-finite trained or announced
    assert all_finite(trainer.state.params)
    for e in entries:
        v = e["version"]
        weights = tmp_path / "weights" / f"v{v}"
        if weights.exists():
            assert all_finite(restore_params(weights, CFG))
    rows = [r for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows and all("NaN" not in r and "Infinity" not in r for r in rows)


def read_letters(kafka: KafkaConfig, namespace: str, count: int) -> dict[str, dict[str, Any]]:
    consumer = kafka.consumer(f"{namespace}.dl-audit")
    consumer.subscribe([deadletter_topic(namespace)])
    codec = AvroCodec("DeadLetter")
    letters: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + 60
    while len(letters) < count and time.monotonic() < deadline:
        for m in consumer.consume(100, 1.0):
            if m.error() is None:
                d = codec.decode(m.value() or b"")
                letters[d["key"].decode()] = d
    consumer.close()
    assert len(letters) == count, sorted(letters)
    return letters


def test_a_diverging_trainer_applies_no_non_finite_step_and_stops_with_one_sentence(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    produce_groups(kafka, namespace, 8, seed=21)
    first = Trainer(trainer_config(namespace, tmp_path, max_steps=1), kafka)
    assert first.run() == 1 and first.version == 1
    # the same run resumed with a learning rate that overflows float32: every step would
    # make the parameters infinite
    cfg = trainer_config(
        namespace,
        tmp_path,
        grpo=GRPOConfig(learning_rate=1e39, warmup_steps=1),
        max_nonfinite_steps=3,
    )
    trainer = Trainer(cfg, kafka)
    with pytest.raises(TrainingDivergedError, match="3 training steps in a row") as caught:
        trainer.run()
    assert "\n" not in str(caught.value)
    assert trainer.version == 1 and trainer.nonfinite_steps == 3
    assert all_finite(trainer.state.params)
    entries = read_ledger(tmp_path / "ledger.jsonl")
    skipped = [d for e in entries for d in e["dropped"] if d[4] == "non_finite_step"]
    assert len(skipped) == 3 * 2 * 4  # three steps of two groups of four, settled
    versions = sorted(int(p.name[1:]) for p in (tmp_path / "weights").glob("v*"))
    assert versions == [1]
    assert all_finite(restore_params(tmp_path / "weights" / "v1", CFG))
    # restarted, it resumes from the intact checkpoint: nothing trained twice
    again = Trainer(cfg, kafka)
    assert again.version == 1 and all_finite(again.state.params)
    again.consumer.close()


@pytest.mark.parametrize("timestamps", ["LogAppendTime", "CreateTime"])
def test_a_producer_clock_ten_minutes_slow_loses_nothing_to_stale_range_skipping(
    kafka: KafkaConfig, namespace: str, tmp_path: Path, timestamps: str
) -> None:
    overrides = {"rollouts": {"message.timestamp.type": timestamps}}
    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1, overrides=overrides))
    produce_groups(kafka, namespace, 4, seed=31)
    trainer = Trainer(trainer_config(namespace, tmp_path, max_staleness=1), kafka)
    run_until(trainer, lambda: trainer.version >= 2)
    # 100 fresh records (the trainer's own version) from a producer whose clock is 10
    # minutes slow: CreateTime would date them before every announcement
    from pipeline.kafka.transport import TrajectoryWriter

    writer = TrajectoryWriter(kafka, namespace)
    slow_ms = int(time.time() * 1000) - 600_000
    rng = np.random.default_rng(32)
    fresh = []
    for g in range(25):
        for i in range(4):
            t = member(f"slow-{g}", i, rng, versions=(2,))
            writer._producer.produce(
                rollout_topic(namespace, "math"),
                CODEC.encode(t),
                t.group_id.encode(),
                headers=CODEC.headers(t),
                timestamp=slow_ms,
            )
            fresh.append(t.trajectory_id)
    writer.flush()
    trainer = Trainer(trainer_config(namespace, tmp_path, max_staleness=1), kafka)
    topic = rollout_topic(namespace, "math")
    high = 16 + len(fresh)
    done: list[bool] = []

    def settled() -> bool:  # (latched: a stopped trainer forgets its partitions)
        if trainer.tracker.low((topic, 0)) >= high:
            done.append(True)
        return bool(done)

    run_until(trainer, settled, timeout=120)
    # every slow record was read: trained, or (as the trainer moved on) dropped as stale
    # one by one from its headers; none was skipped unread as part of a stale range
    assert trainer.drops.get("stale_range", 0) == 0
    entries = read_ledger(tmp_path / "ledger.jsonl")
    outcome = {t[3]: "trained" for e in entries for t in e["trained"] if t[1] == topic}
    outcome |= {
        d[3]: d[4] for e in entries for d in e["dropped"] if d[1] == topic and isinstance(d[3], int)
    }
    read = [outcome.get(o) for o in range(16, high)]
    assert set(read) <= {"trained", "stale"} and read.count("trained") >= 8, read
    assert trainer.stale_ranges._timestamp_types == {topic: timestamps == "LogAppendTime"}


def test_replay_and_profile_read_past_hostile_records(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    from pipeline.kafka.replay import read_recording, record
    from pipeline.kafka.topics import telemetry_topic
    from pipeline.observe import profile

    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    rng = np.random.default_rng(41)
    kinds = hostile(rng, CODEC.encode(member("g", 0, rng)))
    p = kafka.producer()
    p.produce(rollout_topic(namespace, "math"), kinds["overflow"][0][0], b"overflow")
    p.produce(telemetry_topic(namespace), b"\xc3\x01 not telemetry", b"garbage")
    p.flush(10)
    ids = produce_groups(kafka, namespace, 1, seed=42)
    stats = record(kafka, namespace, tmp_path / "rec.avro")
    assert (stats.records, stats.undecodable) == (5, 1)
    records = list(read_recording(tmp_path / "rec.avro"))
    assert sorted(r.trajectory.trajectory_id for r in records if r.trajectory) == sorted(ids)
    bad = [r for r in records if r.trajectory is None]
    assert bad[0].key == b"overflow" and (bad[0].error or "").startswith("tensor_mismatch")
    telemetry = profile.read(kafka, namespace, timeout_s=30)
    assert telemetry.undecodable == 1 and profile.summarize(telemetry)["undecodable_records"] == 1


class _RawName(str):
    """A header name kafka-python writes as these bytes (not UTF-8), as a client in
    another language may."""

    raw = b"\xff\xfe"

    def encode(self, *args: Any, **kwargs: Any) -> bytes:  # type: ignore[override]
        return self.raw


def produce_with_raw_header_name(bootstrap: str, topic: str, key: bytes, value: bytes) -> None:
    """One record whose header name is the bytes FF FE, written by kafka-python (another
    client than the one rlstream reads with)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap)
    try:
        producer.send(topic, value=value, key=key, headers=[(_RawName("x"), b"1")]).get(30)
    finally:
        producer.close(10)


def test_a_header_name_that_is_not_utf8_is_dead_lettered_and_the_trainer_goes_on(
    bootstrap: str, kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    """Through the real broker, a header name of bytes FF FE crashed the trainer (the
    client's second ``headers()`` call on the message is a segmentation fault): it is
    dead-lettered as ``bad_header``, ``rlstream train`` trains the good groups around it
    and exits 0, and a recording of the topic keeps it as an undecodable record."""
    import subprocess

    from pipeline.kafka.replay import record
    from tests.integration.faults import cli

    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    topic = rollout_topic(namespace, "math")
    before = produce_groups(kafka, namespace, 2, seed=51)
    rng = np.random.default_rng(52)
    produce_with_raw_header_name(bootstrap, topic, b"bad-header", CODEC.encode(member("h", 0, rng)))
    after = produce_groups(kafka, namespace, 2, seed=53)
    run_dir = tmp_path / "run"
    done = subprocess.run(
        cli(
            "train",
            "--bootstrap",
            bootstrap,
            "--namespace",
            namespace,
            "--run-dir",
            str(run_dir),
            "--groups-per-batch",
            "2",
            "--group-size",
            "4",
            "--max-steps",
            "2",
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    entries = read_ledger(run_dir / "ledger.jsonl")
    trained = {t[0] for e in entries for t in e["trained"]}
    assert set(before) | set(after) <= trained
    assert [d[4] for e in entries for d in e["dropped"]] == ["bad_header"]
    letter = read_letters(kafka, namespace, 1)["bad-header"]
    assert letter["error_class"] == "bad_header"
    assert letter["headers"] == {}
    stats = record(kafka, namespace, tmp_path / "rec.avro")
    assert (stats.records, stats.undecodable) == (17, 1)
