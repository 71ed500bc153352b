"""Against the real broker: trajectories with keys and headers, consumer-group resume,
an 8 MB trajectory, compaction of the weights topic, idempotent topic creation."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import (
    ensure_topics,
    namespace_topics,
    rollout_topic,
    rollout_topics,
    weights_topic,
)
from pipeline.kafka.transport import Decoded, TrajectoryReader, TrajectoryWriter
from pipeline.records.codec import AvroCodec, TrajectoryHeaders
from pipeline.testing import make_trajectory

pytestmark = pytest.mark.integration


def test_round_trip_with_keys_and_headers(kafka: KafkaConfig, namespace: str) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["math", "maze"], 3))
    writer = TrajectoryWriter(kafka, namespace)
    sent = {}
    rng = np.random.default_rng(0)
    for g in range(6):
        for i in range(4):
            t = make_trajectory(
                200,
                rng=rng,
                env="math" if g % 2 else "maze",
                group_id=f"group-{g}",
                group_size=4,
                group_index=i,
                versions=(g, g + 1),
            )
            writer.write(t)
            sent[t.trajectory_id] = t
    writer.flush()
    assert writer.delivered == 24 and writer.failed == 0 and writer.settled() == 24

    topics = list(rollout_topics(kafka, namespace).values())
    assert sorted(topics) == [rollout_topic(namespace, "math"), rollout_topic(namespace, "maze")]
    reader = TrajectoryReader(kafka, topics, f"{namespace}.trainer")
    got = reader.read(24)
    reader.close()
    partitions: dict[str, set[int]] = {}
    for r in got:
        assert isinstance(r, Decoded)
        t = r.trajectory
        original = sent.pop(t.trajectory_id)
        assert t.tokens.tobytes() == original.tokens.tobytes()
        assert r.where.topic == rollout_topic(namespace, t.env)
        partitions.setdefault(t.group_id, set()).add(r.where.partition)
    assert not sent
    # every member of a group landed in one partition (key = group id)
    assert all(len(p) == 1 for p in partitions.values())


def test_headers_and_key_on_the_wire(kafka: KafkaConfig, namespace: str) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    writer = TrajectoryWriter(kafka, namespace)
    t = make_trajectory(123, env="math", group_id="g-42", versions=(5, 6))
    writer.write(t)
    writer.flush()
    consumer = kafka.consumer(f"{namespace}.raw")
    consumer.subscribe([rollout_topic(namespace, "math")])
    msg = None
    deadline = time.monotonic() + 30
    while msg is None and time.monotonic() < deadline:
        m = consumer.poll(0.5)
        if m is not None and m.error() is None:
            msg = m
    consumer.close()
    assert msg is not None
    assert msg.key() == b"g-42"
    h = TrajectoryHeaders.parse(msg.headers())
    assert (h.env, h.group_id, h.min_version, h.max_version, h.num_tokens) == (
        "math",
        "g-42",
        5,
        6,
        123,
    )
    assert h.schema == writer.codec.fingerprint


def test_group_commit_and_resume(kafka: KafkaConfig, namespace: str) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    writer = TrajectoryWriter(kafka, namespace)
    ids = []
    for i in range(20):
        t = make_trajectory(50, env="math", group_id=f"g{i}")
        writer.write(t)
        ids.append(t.trajectory_id)
    writer.flush()
    topic = rollout_topic(namespace, "math")
    group = f"{namespace}.trainer"

    first = TrajectoryReader(kafka, [topic], group)
    got = first.read(8, timeout=30)
    # commit the position after the 8th record, as a trainer does after its checkpoint
    from confluent_kafka import TopicPartition

    last = got[-1].where
    first.consumer.commit(
        offsets=[TopicPartition(topic, last.partition, last.offset + 1)], asynchronous=False
    )
    first.close()

    second = TrajectoryReader(kafka, [topic], group)
    rest = second.read(12, timeout=30)
    second.close()
    seen = [r.trajectory.trajectory_id for r in got + rest if isinstance(r, Decoded)]
    assert seen == ids  # in order, nothing twice, nothing lost


def test_eight_megabyte_trajectory(kafka: KafkaConfig, namespace: str) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["big"], 1))
    # 1 M tokens: 4 MB of tokens, 1 MB of mask, 4 MB of log-probabilities
    t = make_trajectory(1_000_000, env="big", turns=2)
    writer = TrajectoryWriter(kafka, namespace)
    writer.write(t)
    writer.flush()
    assert writer.bytes > 8_000_000
    reader = TrajectoryReader(kafka, [rollout_topic(namespace, "big")], f"{namespace}.big")
    (r,) = reader.read(1, timeout=60)
    reader.close()
    assert isinstance(r, Decoded)
    assert r.size > 8_000_000
    assert np.array_equal(r.trajectory.tokens, t.tokens)


def test_weights_topic_is_compacted(kafka: KafkaConfig, namespace: str) -> None:
    # Short segments so the broker's cleaner has closed segments to compact in seconds.
    ensure_topics(
        kafka,
        namespace_topics(namespace, ["math"], 1, overrides={"weights": {"segment.ms": "200"}}),
    )
    topic = weights_topic(namespace)
    codec = AvroCodec("WeightsAnnouncement")
    producer = kafka.producer()
    for version in range(30):
        producer.produce(topic, codec.encode(_announcement(version)), b"policy")
        producer.flush()
        time.sleep(0.05)

    def read_all() -> list[int]:
        consumer = kafka.consumer(f"{namespace}.w{uuid.uuid4().hex[:6]}")
        consumer.subscribe([topic])
        out: list[int] = []
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < (1.5 if out else 20):
            m = consumer.poll(0.2)
            if m is not None and m.error() is None:
                out.append(codec.decode(m.value())["policy_version"])
                quiet_since = time.monotonic()
        consumer.close()
        return out

    deadline = time.monotonic() + 90
    versions = read_all()
    assert versions[-1] == 29
    while len(versions) >= 30 and time.monotonic() < deadline:
        time.sleep(2)
        # another record rolls the active segment so the old ones can be cleaned
        producer.produce(topic, codec.encode(_announcement(29)), b"policy")
        producer.flush()
        versions = read_all()
    assert len(versions) < 30, "the broker never compacted the weights topic"
    assert versions[-1] == 29


def test_topic_creation_is_idempotent(kafka: KafkaConfig, namespace: str) -> None:
    specs = namespace_topics(namespace, ["a", "b"], 2)
    first = ensure_topics(kafka, specs)
    assert {s.action for s in first} == {"created"}
    assert {s.name: s.partitions for s in first}[rollout_topic(namespace, "a")] == 2
    weights = {s.name: s for s in first}[weights_topic(namespace)]
    assert weights.config["cleanup.policy"] == "compact"
    again = ensure_topics(kafka, specs)
    assert {s.action for s in again} == {"exists"}
    grown = ensure_topics(kafka, namespace_topics(namespace, ["a", "b"], 4))
    actions = {s.name: s.action for s in grown}
    assert actions[rollout_topic(namespace, "a")] == "grown"
    assert {s.name: s.partitions for s in grown}[rollout_topic(namespace, "b")] == 4


def _announcement(version: int) -> dict[str, object]:
    return {
        "policy_version": version,
        "step": version,
        "checkpoint_uri": f"/ckpt/{version}",
        "digest": "sha256:" + "0" * 64,
        "format": "orbax",
        "model_config": "{}",
        "tokenizer_id": "bytes-v1",
        "created_at_ms": int(time.time() * 1000),
        "trainer_id": "trainer-0",
        "metrics": {"loss": 0.5},
        "transfer": None,
        "base_transfer": None,
    }


def test_a_full_local_queue_refuses_a_write_that_may_not_wait(
    kafka: KafkaConfig, namespace: str
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    # room for one record in the client's queue, kept there for a minute
    writer = TrajectoryWriter(
        kafka, namespace, **{"queue.buffering.max.messages": 1, "linger.ms": 60_000}
    )
    first, second = (make_trajectory(50, env="math", group_id=f"g{i}") for i in range(2))
    assert writer.write(first, wait=False)
    assert not writer.write(second, wait=False)  # nothing written, nothing counted
    assert writer.sent == 1
    writer.flush(30)
    assert writer.write(second, wait=False) and writer.sent == 2
    writer.flush(30)
    assert writer.delivered == 2 and writer.failed == 0
