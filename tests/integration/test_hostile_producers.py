"""Producers against hostile weights announcements and failing episodes, through the
real broker: every bad announcement is refused with a reason while the weights thread
lives on; an episode whose record cannot be written becomes a failed record of its group;
a producer whose episodes all fail stops with one sentence. Results in
docs/reliability.md."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from connectors.base import Environment, Step, Task, register
from pipeline.errors import ProducerFailedError
from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import ensure_topics, namespace_topics
from pipeline.kafka.weights import announce, announcement
from pipeline.policy.checkpoint import save_params
from pipeline.policy.model import init_model
from pipeline.policy.tokenizer import TOKENIZER_ID
from pipeline.rollout.producer import RolloutProducer
from tests.integration.test_producer import (
    CFG,
    producer_config,
    read_all,
    run_in_thread,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_hostile_announcements_are_refused_and_the_weights_thread_lives_on(
    kafka: KafkaConfig, namespace: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 1))
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    p = kafka.producer()
    # before the producer starts: a valid version 2, then a version from the future whose
    # files say 2, then a model configuration that divides by zero
    v2 = save_params(root / "v2", init_model(CFG, 2), version=2)
    announce(p, namespace, announcement(2, 2, v2, CFG, TOKENIZER_ID, "t"))
    announce(p, namespace, announcement(10**9, 10**9, v2, CFG, TOKENIZER_ID, "t"))
    zero = announcement(3, 3, v2, CFG, TOKENIZER_ID, "t")
    zero["model_config"] = json.dumps({**json.loads(CFG.to_json()), "num_heads": 0})
    announce(p, namespace, zero)
    caplog.set_level(logging.WARNING, logger="pipeline.kafka.weights")
    producer = RolloutProducer(producer_config(namespace, checkpoint_roots=(root,)), kafka)
    th = run_in_thread(producer)
    weights = producer.weights
    assert weights is not None
    # the newest that loads is taken: version 2 (not 0 for ever, not 10**9)
    wait_for(lambda: producer.version == 2, 60)

    # a linked sub-directory that leaves the allowed root
    v4 = save_params(root / "v4", init_model(CFG, 4), version=4)
    (outside / "extra").mkdir()
    (v4 / "linked").symlink_to(outside / "extra")
    announce(p, namespace, announcement(4, 4, v4, CFG, TOKENIZER_ID, "t"))
    # parameters that are NaN
    nan_model = init_model(CFG, 5)
    state = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), nnx_params(nan_model))
    nnx_update(nan_model, state)
    v5 = save_params(root / "v5", nan_model, version=5)
    announce(p, namespace, announcement(5, 5, v5, CFG, TOKENIZER_ID, "t"))
    # a 4 MB model configuration
    huge = announcement(6, 6, v2, CFG, TOKENIZER_ID, "t")
    huge["model_config"] = json.dumps({"pad": "x" * 4_000_000})
    announce(p, namespace, huge)
    wait_for(lambda: sum(weights.refused.values()) >= 5, 60)
    # the thread is alive: a valid announcement after all of them loads
    v7 = save_params(root / "v7", init_model(CFG, 7), version=7)
    announce(p, namespace, announcement(7, 7, v7, CFG, TOKENIZER_ID, "t"))
    wait_for(lambda: producer.version == 7, 60)
    producer.stop()
    th.join(60)
    assert dict(weights.refused) == {
        "version": 1,  # 10**9, whose files say 2
        "model_config": 2,  # num_heads 0, the 4 MB one
        "uri": 1,  # the link out of the root
        "non_finite": 1,
    }
    refusals = [r.getMessage() for r in caplog.records if "weights refused" in r.getMessage()]
    assert refusals and max(len(line) for line in refusals) < 1000


def nnx_params(model: Any) -> Any:
    from flax import nnx

    return nnx.state(model, nnx.Param)


def nnx_update(model: Any, state: Any) -> None:
    from flax import nnx

    nnx.update(model, state)


class Broken(Environment):
    """An environment whose every reset fails."""

    name = "broken"

    def sample_task(self, rng: random.Random) -> Task:
        return Task("x")

    async def reset(self, task: Task) -> str:
        raise ConnectionError("the sandbox is gone")

    async def step(self, action: str) -> Step:
        raise AssertionError("never reached")


register("broken", Broken)


def test_a_producer_whose_episodes_all_fail_stops_with_one_sentence(
    kafka: KafkaConfig, namespace: str
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["broken"], 1))
    producer = RolloutProducer(
        producer_config(namespace, env="broken", max_consecutive_failures=24), kafka
    )
    with pytest.raises(ProducerFailedError, match="the last 24 episodes all failed") as e:
        producer.run()
    assert "\n" not in str(e.value)
    st = producer.stats
    assert st.started == sum(st.finished.values()) + st.dropped  # nothing left in flight
    assert producer.writer.delivered == sum(st.finished.values())


def test_an_episode_whose_record_cannot_be_encoded_is_written_as_a_failed_record(
    kafka: KafkaConfig, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipeline.rollout.producer as producer_module

    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 1))
    real = producer_module.run_episode
    calls = [0]

    async def sometimes_nan(*args: Any, **kw: Any) -> Any:
        t = await real(*args, **kw)
        calls[0] += 1
        if calls[0] % 3 == 0:  # as if the policy had sampled NaN log-probabilities
            t.logprobs = np.full_like(t.logprobs, np.nan)
            t.loss_mask = np.ones_like(t.loss_mask)
        if calls[0] % 5 == 0:  # or the episode code itself failed
            raise RuntimeError("a bug in an episode")
        return t

    monkeypatch.setattr(producer_module, "run_episode", sometimes_nan)
    producer = RolloutProducer(producer_config(namespace, max_episodes=24), kafka)
    st = producer.run()
    assert sum(st.finished.values()) == 24 and st.failed >= 4
    records = read_all(kafka, namespace, 24)
    groups: dict[str, list[int]] = {}
    for r in records:
        groups.setdefault(r.trajectory.group_id, []).append(r.trajectory.group_index)
    assert all(sorted(v) == [0, 1, 2, 3] for v in groups.values())  # every group complete
    failed = [r.trajectory for r in records if "error" in r.trajectory.metadata]
    assert len(failed) == st.failed and all(t.status == "env_error" for t in failed)
    assert {t.metadata["error"].split(":")[0] for t in failed} <= {
        "record refused",
        "RuntimeError",
    }


class Hanging(Broken):
    """An environment whose every step hangs."""

    name = "hanging"

    async def reset(self, task: Task) -> str:
        return "go"

    async def step(self, action: str) -> Step:
        import asyncio

        await asyncio.Event().wait()
        raise AssertionError("never reached")


register("hanging", Hanging)


def test_episodes_dropped_at_shutdown_are_counted_once(kafka: KafkaConfig, namespace: str) -> None:
    from pipeline.rollout.config import EpisodeLimits

    ensure_topics(kafka, namespace_topics(namespace, ["hanging"], 1))
    cfg = producer_config(
        namespace,
        env="hanging",
        grace_s=0.5,
        limits=EpisodeLimits(max_new_tokens=4, step_timeout_s=600, episode_timeout_s=600),
    )
    producer = RolloutProducer(cfg, kafka)
    th = run_in_thread(producer)
    wait_for(lambda: producer.stats.started >= 8, 60)
    producer.stop()
    th.join(60)
    st = producer.stats
    assert st.dropped == st.started > 0 and sum(st.finished.values()) == 0
