"""Positions, group buffering, batch assembly and the GRPO step, without a broker."""

from __future__ import annotations

from typing import Any
from unittest.mock import ANY

import jax.numpy as jnp
import numpy as np
import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from pipeline.kafka.transport import Coordinates
from pipeline.policy.config import ModelConfig
from pipeline.policy.model import init_model, token_logprobs
from pipeline.testing import make_trajectory
from pipeline.train.advantages import advantages
from pipeline.train.batching import (
    Group,
    GroupBuffer,
    GroupQueue,
    Refused,
    all_rewards,
    assemble,
    bucket_for,
    group_rewards,
)
from pipeline.train.config import GRPOConfig
from pipeline.train.grpo import init_state, make_train_step
from pipeline.train.objective import Batch
from pipeline.train.positions import PositionTracker
from pipeline.train.stale import StaleRanges

TP = ("ns.rollouts.a", 0)


def test_low_waits_for_the_oldest_unsettled_record() -> None:
    t = PositionTracker()
    for o in range(10, 16):
        t.read(TP, o)
    t.settle(TP, 12)
    t.settle(TP, 14)
    assert t.low(TP) == 10
    t.settle(TP, 10)
    t.settle(TP, 11)
    assert t.low(TP) == 13
    restored = PositionTracker.from_json(t.to_json())
    assert restored.low(TP) == 13
    assert restored.is_settled(TP, 14) and not restored.is_settled(TP, 13)
    assert not restored.is_settled(TP, 15) and restored.is_settled(TP, 12)
    restored.skip(TP, 14)
    restored.read(TP, 13)
    restored.settle(TP, 13)
    assert restored.low(TP) == 15


def test_ranges_settle_without_reading() -> None:
    t = PositionTracker()
    t.read(TP, 0)
    t.settle_range(TP, 1, 1000)
    assert t.low(TP) == 0 and t.is_settled(TP, 500) and t.next(TP) == 1000
    t.settle(TP, 0)
    assert t.low(TP) == 1000


def test_a_partition_let_go_is_read_again_from_its_low_and_skips_what_was_settled() -> None:
    """A revoked partition (given back by the next rebalance): its pending records are
    read again, its settled ones are not settled twice, and its position stays."""
    t = PositionTracker()
    for o in range(10):
        t.read(TP, o)
    t.settle_range(TP, 0, 3)
    t.settle_range(TP, 5, 7)
    t.let_go(TP)
    assert TP in t.partitions() and t.low(TP) == 3 and t.next(TP) == 3
    assert t.pending_count(TP) == 0
    assert [o for o in range(10) if t.is_settled(TP, o)] == [0, 1, 2, 5, 6]
    for o in range(3, 10):  # read again: the settled ones are skipped
        t.skip(TP, o) if t.is_settled(TP, o) else t.read(TP, o)
    assert t.pending_count(TP) == 5 and t.low(TP) == 3
    for o in (3, 4, 7, 8, 9):
        t.settle(TP, o)
    assert t.low(TP) == 10


def where(o: int) -> Coordinates:
    return Coordinates(*TP, o, 0)


def test_groups_complete_expire_and_overflow() -> None:
    buf = GroupBuffer(max_records=5, timeout_s=10)
    ts = [make_trajectory(8, group_id="g", group_size=3, group_index=i) for i in range(3)]
    assert buf.add(ts[0], where(0)) is None
    # the same record again, and its trajectory id at another index: refused, first kept
    assert buf.add(ts[0], where(1)) == Refused("duplicate", ANY)
    twin = make_trajectory(8, group_id="g", group_size=3, group_index=2)
    twin.trajectory_id = ts[0].trajectory_id
    assert buf.add(twin, where(2)).reason == "duplicate"  # type: ignore[union-attr]
    alien = make_trajectory(8, env="other", group_id="g", group_size=3, group_index=1)
    assert buf.add(alien, where(2)).reason == "env_mismatch"  # type: ignore[union-attr]
    assert buf.add(ts[1], where(2)) is None
    g = buf.add(ts[2], where(3))
    assert isinstance(g, Group) and g.complete and buf.records == 0
    assert [m.trajectory for m in g.members.values()] == ts
    # a late repeat of a completed group does not start it again
    assert buf.add(ts[1], where(4)).reason == "duplicate"  # type: ignore[union-attr]
    assert buf.records == 0
    for i in range(3):
        buf.add(make_trajectory(8, group_id=f"h{i}", group_size=2), where(10 + i))
    assert [len(x.members) for x in buf.expired(now=1e12)] == [1, 1, 1]
    for i in range(7):
        buf.add(make_trajectory(8, group_id=f"k{i}", group_size=2), where(20 + i))
    assert len(buf.overflow()) == 2 and buf.records == 5


def test_a_group_past_its_deadline_goes_with_the_members_it_has() -> None:
    buf = GroupBuffer(max_records=100, timeout_s=60)
    ts = {
        gid: [make_trajectory(8, group_id=gid, group_size=4, group_index=i) for i in range(4)]
        for gid in ("two", "one", "whole")
    }
    for gid, n in (("two", 2), ("one", 1), ("whole", 3)):
        for i in range(n):
            assert buf.add(ts[gid][i], where(i)) is None
    start = min(g.first_seen for g in buf)
    assert buf.due(5.0, 2, now=start + 4.0) == []  # not yet
    due = buf.due(5.0, 2, now=start + 6.0)
    # "two" and "whole" have two members or more; "one" waits on (and expires later)
    assert sorted((g.group_id, len(g.members)) for g in due) == [("two", 2), ("whole", 3)]
    assert buf.records == 1 and [g.group_id for g in buf] == ["one"]
    # a member that missed its group's deadline is late; a repeat of one trained is not
    assert buf.add(ts["two"][3], where(9)) == Refused("late", ANY)
    assert buf.add(ts["two"][0], where(9)) == Refused("duplicate", ANY)
    assert buf.add(ts["whole"][3], where(9)).reason == "late"  # type: ignore[union-attr]
    assert [g.group_id for g in buf.expired(now=start + 61.0)] == ["one"]


def test_a_late_member_kept_goes_alone_with_its_group_s_rewards_as_the_baseline() -> None:
    """With ``late_rewards`` (``late_members: train``) a member that comes after its group
    was trained at its deadline is handed out alone with the rewards the group was
    trained with; its advantage is the one it would have had among them. A repeat of it
    is a duplicate; let go before training (a rebalance), it is late again when read
    again, and its group's trained members stay trained."""
    grpo = GRPOConfig()
    buf = GroupBuffer(max_records=100, timeout_s=60, late_rewards=lambda g: group_rewards(g, grpo))
    ts = [
        make_trajectory(8, group_id="g", group_size=4, group_index=i, reward=r)
        for i, r in enumerate((1.0, 0.0, 0.0, 1.0))
    ]
    for i in range(3):
        assert buf.add(ts[i], where(i)) is None
    (trained,) = buf.due(5.0, 2, now=min(g.first_seen for g in buf) + 6.0)
    assert sorted(trained.members) == [0, 1, 2]
    late = buf.add(ts[3], where(3))
    assert isinstance(late, Group) and late.late and sorted(late.members) == [3]
    assert late.baseline is not None and late.baseline.tolist() == [1.0, 0.0, 0.0]
    assert all_rewards(late, grpo).tolist() == [1.0, 0.0, 0.0, 1.0]
    batch, _ = assemble([late], 2, (64,))
    expected = advantages(np.asarray([1.0, 0.0, 0.0, 1.0]), "grpo")[3]
    assert float(batch.advantage[0]) == pytest.approx(expected) and expected > 0
    assert buf.add(ts[3], where(3)) == Refused("duplicate", ANY)
    buf.forget_done([late])
    again = buf.add(ts[3], where(3))
    assert isinstance(again, Group) and again.late and again.baseline is not None
    assert buf.add(ts[0], where(0)) == Refused("duplicate", ANY)  # trained at the deadline
    # without late_rewards (the default, late_members: drop) it is refused as late
    plain = GroupBuffer(max_records=100, timeout_s=60)
    for i in range(3):
        plain.add(ts[i], where(i))
    plain.due(5.0, 2, now=min(g.first_seen for g in plain) + 6.0)
    assert plain.add(ts[3], where(3)) == Refused("late", ANY)


def test_queue_follows_mixing_weights() -> None:
    q = GroupQueue({"a": 3.0, "b": 1.0})
    buf = GroupBuffer(100, 10)
    for env in ("a", "b"):
        for i in range(20):
            g = buf.add(make_trajectory(4, env=env, group_id=f"{env}{i}"), where(i))
            assert g is not None
            q.put(g)
    taken = [g.env for g in q.take(8)]
    assert taken.count("a") == 6 and taken.count("b") == 2
    # a revoked partition's queued groups are let go, the others stay queued
    other = ("ns.rollouts.a", 1)
    g = buf.add(make_trajectory(4, env="a", group_id="elsewhere"), Coordinates(*other, 0, 0))
    assert g is not None
    q.put(g)
    before = len(q)
    assert q.drop_partitions({other}) == [g] and len(q) == before - 1
    assert len(q.drop_partitions({TP})) == before - 1 and len(q) == 0


def test_queue_takes_the_oldest_policy_version_first() -> None:
    """Groups arrive from several partitions and producers in no global order: the one
    whose deadline (its oldest member's version) comes first is trained first, arrival
    order among equals, a group without a version (-1) before any with one."""
    q = GroupQueue({})
    buf = GroupBuffer(100, 10)
    arrivals = [("new", 5, 5), ("old", 3, 6), ("mixed", 4, 2), ("old-too", 3, 3), ("none", -1, 4)]
    for n, (gid, first, second) in enumerate(arrivals):
        for i, v in enumerate((first, second)):
            t = make_trajectory(4, group_id=gid, group_size=2, group_index=i, versions=(v, v))
            g = buf.add(t, where(10 * n + i))
        assert g is not None and g.oldest_version == min(first, second)
        q.put(g)
    assert [g.group_id for g in q.take(2)] == ["none", "mixed"]
    assert [g.group_id for g in q.take(9)] == ["old", "old-too", "new"]
    assert len(q) == 0


def test_assemble_pads_to_a_bucket_and_normalises_rewards() -> None:
    buf = GroupBuffer(100, 10)
    groups = []
    for gid, rewards in (("x", [1.0, 0.0]), ("y", [0.5, 0.5])):
        for i, r in enumerate(rewards):
            g = buf.add(
                make_trajectory(20 + i, group_id=gid, group_size=2, group_index=i, reward=r),
                where(i),
            )
        groups.append(g)
    batch, members = assemble(groups, rows=6, buckets=(16, 32, 64))  # type: ignore[arg-type]
    assert batch.tokens.shape == (6, 32) and len(members) == 4
    np.testing.assert_allclose(batch.advantage[:4], [1, -1, 0, 0], atol=1e-4)
    assert batch.valid.tolist() == [1, 1, 1, 1, 0, 0]
    assert batch.mask[0, :20].tolist() == members[0].trajectory.loss_mask.tolist()
    assert bucket_for(65, (16, 32, 64)) is None


CFG = ModelConfig(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=64)


def _batch(model, rows: int, length: int, seed: int) -> Batch:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 256, (rows, length)), jnp.int32)
    mask = jnp.asarray(np.arange(length)[None] >= length // 2, jnp.float32) * jnp.ones((rows, 1))
    behaviour = token_logprobs(model, tokens) * mask
    adv = jnp.asarray(rng.standard_normal(rows), jnp.float32)
    return Batch(tokens, mask, behaviour, adv, jnp.ones(rows))


@pytest.mark.parametrize("correction", ["decoupled", "tis"])
def test_step_lowers_the_loss_and_never_recompiles(correction: str) -> None:
    cfg = GRPOConfig(correction=correction, learning_rate=1e-2, warmup_steps=1, minibatches=2)
    tx = cfg.optimizer()
    model = init_model(CFG, seed=0)
    graphdef, state = init_state(model, tx)
    step = make_train_step(graphdef, cfg, tx)
    batch = _batch(model, 8, 32, 0)
    losses = []
    for i in range(6):
        state, metrics = step(state, batch if i < 4 else _batch(model, 8, 32, i))
        losses.append(float(metrics["loss"]))
    assert losses[3] < losses[0]
    assert step._cache_size() == 1  # new batches of the same bucket: no recompilation
    state, _ = step(state, _batch(model, 8, 16, 9))  # another bucket: one more
    assert step._cache_size() == 2
    assert int(state.step) == 7
    assert float(metrics["clip_fraction"]) >= 0 and float(metrics["entropy"]) > 0


@pytest.mark.parametrize("minibatches", [1, 2])
def test_on_policy_importance_weights_are_one(minibatches: int) -> None:
    cfg = GRPOConfig(kl_coef=0.01, minibatches=minibatches)
    tx = cfg.optimizer()
    model = init_model(CFG, seed=0)
    graphdef, state = init_state(model, tx)
    _, metrics = make_train_step(graphdef, cfg, tx)(state, _batch(model, 4, 16, 1))
    assert abs(float(metrics["is_weight_mean"]) - 1) < 1e-3
    assert float(metrics["is_truncated_fraction"]) == 0
    assert abs(float(metrics["kl_ref"])) < 1e-4  # the first step starts at the reference


def test_one_update_per_step_takes_the_proximal_policy_from_its_own_pass() -> None:
    """With one minibatch the proximal log-probabilities come from the update's own
    forward pass, so the ratio is exactly 1 and, on-policy, the loss is the
    mask-weighted mean of ``-advantage``."""
    model = init_model(CFG, seed=0)
    batch = _batch(model, 4, 16, 3)
    cfg = GRPOConfig(minibatches=1, aggregation="token_mean")
    tx = cfg.optimizer()
    graphdef, state = init_state(model, tx)
    _, metrics = make_train_step(graphdef, cfg, tx)(state, batch)
    expected = -float(jnp.sum(batch.advantage[:, None] * batch.mask) / jnp.sum(batch.mask))
    assert float(metrics["loss"]) == pytest.approx(expected, rel=1e-3, abs=1e-5)
    assert float(metrics["clip_fraction"]) == 0
    assert "kl_ref" not in metrics  # no reference pass without a KL term


def test_unsettled_parts_of_a_range() -> None:
    t = PositionTracker()
    for o in range(0, 10):
        t.read(TP, o)
    t.settle_range(TP, 0, 3)
    t.settle(TP, 5)
    t.settle_range(TP, 6, 10)
    restored = PositionTracker.from_json(t.to_json())
    assert restored.low(TP) == 3
    assert restored.unsettled(TP, 0, 20) == [(3, 5), (10, 20)]


def test_stale_ranges_looked_up_while_the_broker_is_away_skip_nothing() -> None:
    """Right after a broker restart the partitions are unknown for a moment: the lookup
    of stale ranges answers "nothing to skip" (the records are filtered one by one as
    they are read), where it used to end the trainer with the consumer's exception."""

    class Away:
        def offsets_for_times(self, partitions: Any, timeout: float = 0) -> Any:
            raise KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION))

    class Back:
        def offsets_for_times(self, partitions: Any, timeout: float = 0) -> Any:
            return [TopicPartition(p.topic, p.partition, 7) for p in partitions]

    ranges = StaleRanges(None)
    ranges._timestamp_types[TP[0]] = True  # a LogAppendTime topic
    assert ranges.until(Away(), [TopicPartition(*TP)], 1000) == {}
    assert ranges.until(Back(), [TopicPartition(*TP)], 1000) == {TP: 7}
