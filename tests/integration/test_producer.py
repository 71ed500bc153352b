"""Rollout producers against the real broker: records, weights reload, refused
announcements, admission control, clean shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from confluent_kafka import TopicPartition

from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import ensure_topics, namespace_topics, rollout_topic
from pipeline.kafka.transport import Decoded, TrajectoryReader
from pipeline.kafka.weights import announce, announcement
from pipeline.policy.checkpoint import save_params
from pipeline.policy.config import ModelConfig
from pipeline.policy.model import init_model, token_logprobs
from pipeline.policy.tokenizer import TOKENIZER_ID
from pipeline.records.codec import TrajectoryHeaders
from pipeline.rollout.config import AdmissionConfig, EpisodeLimits, ProducerConfig
from pipeline.rollout.producer import RolloutProducer
from pipeline.rollout.status import status_line

pytestmark = pytest.mark.integration

CFG = ModelConfig(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=128)


def producer_config(namespace: str, **kw: object) -> ProducerConfig:
    base: dict[str, object] = dict(
        namespace=namespace,
        env="guess",
        concurrency=8,
        group_size=4,
        model=CFG,
        limits=EpisodeLimits(max_new_tokens=4),
        admission=AdmissionConfig(max_staleness=-1),
    )
    base.update(kw)
    return ProducerConfig(**base)  # type: ignore[arg-type]


def read_all(kafka: KafkaConfig, namespace: str, count: int) -> list[Decoded]:
    reader = TrajectoryReader(kafka, [rollout_topic(namespace, "guess")], f"{namespace}.check")
    got = reader.read(count, timeout=60)
    reader.close()
    assert all(isinstance(r, Decoded) for r in got)
    return got  # type: ignore[return-value]


def test_records_arrive_decodable_with_keys_and_headers(kafka: KafkaConfig, namespace: str) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 2))
    producer = RolloutProducer(producer_config(namespace, max_episodes=16), kafka)
    stats = producer.run()
    assert sum(stats.finished.values()) == 16
    status = status_line(producer)  # every record checked against its text at once
    assert status["exactness_checked"] == 16 and status["divergent_context"] == 0
    # the time admission held it back, by cause, within its running time; nothing in flight
    assert set(status["paused_by"]) == {"weights_behind", "untrained", "in_flight", "joining"}
    assert 0 <= sum(status["paused_by"].values()) <= status["running_s"]
    assert status["in_flight_age_s"] == {"p50": 0.0, "max": 0.0}
    consumer = kafka.consumer(f"{namespace}.raw")
    consumer.subscribe([rollout_topic(namespace, "guess")])
    msgs = []
    deadline = time.monotonic() + 60
    while len(msgs) < 16 and time.monotonic() < deadline:
        m = consumer.poll(0.5)
        if m is not None and m.error() is None:
            msgs.append(m)
    consumer.close()
    assert len(msgs) == 16
    from pipeline.records.codec import TrajectoryCodec

    codec = TrajectoryCodec()
    groups: dict[str, list[int]] = {}
    for m in msgs:
        t = codec.decode(m.value())
        assert m.key() == t.group_id.encode()
        h = TrajectoryHeaders.parse(m.headers())
        assert (h.env, h.group_id, h.num_tokens, h.min_version) == (
            "guess",
            t.group_id,
            t.num_tokens,
            0,
        )
        assert t.tokenizer_id == TOKENIZER_ID and t.env == "guess"
        groups.setdefault(t.group_id, []).append(t.group_index)
    assert sorted(len(v) for v in groups.values()) == [4, 4, 4, 4]
    assert all(sorted(v) == [0, 1, 2, 3] for v in groups.values())


def run_in_thread(producer: RolloutProducer) -> threading.Thread:
    th = threading.Thread(target=producer.run, daemon=True)
    th.start()
    return th


def wait_for(cond, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.1)


def test_by_default_weights_under_runs_are_taken_and_others_refused_loudly(
    kafka: KafkaConfig,
    namespace: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No --checkpoint-root: a trainer's weights under ./runs load; weights elsewhere
    are refused with one error naming the flag and the folder to give."""
    import logging

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RLSTREAM_CHECKPOINT_ROOT", raising=False)
    caplog.set_level(logging.WARNING, logger="pipeline.kafka.weights")
    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 1))
    cfg = producer_config(namespace)
    assert cfg.checkpoint_roots == (Path("runs"),)
    assert producer_config(namespace, checkpoint_roots=(Path("none"),)).checkpoint_roots == ()
    producer = RolloutProducer(cfg, kafka)
    th = run_in_thread(producer)
    with_kafka = kafka.producer()
    elsewhere = save_params(tmp_path / "elsewhere" / "weights" / "v3", init_model(CFG, 3))
    announce(with_kafka, namespace, announcement(3, 3, elsewhere, CFG, TOKENIZER_ID, "t"))
    weights = producer.weights
    assert weights is not None
    wait_for(lambda: weights.refused["uri"] == 1, 60)
    advice = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(advice) == 1
    assert f"--checkpoint-root {tmp_path / 'elsewhere'}" in advice[0], advice
    assert "keeps sampling version 0" in advice[0]
    ours = save_params(tmp_path / "runs/trainer/weights/v4", init_model(CFG, 4))
    announce(with_kafka, namespace, announcement(4, 4, ours, CFG, TOKENIZER_ID, "t"))
    wait_for(lambda: producer.version == 4, 60)
    producer.stop()
    th.join(60)


def test_announced_weights_are_picked_up_mid_run(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 1))
    producer = RolloutProducer(producer_config(namespace, checkpoint_roots=(tmp_path,)), kafka)
    th = run_in_thread(producer)
    wait_for(lambda: producer.writer.sent >= 8)

    new_model = init_model(CFG, seed=42)
    path = save_params(tmp_path / "v5", new_model)
    with_kafka = kafka.producer()
    announce(with_kafka, namespace, announcement(5, 5, path, CFG, TOKENIZER_ID, "trainer"))
    wait_for(lambda: producer.version == 5, 60)
    assert producer.weights is not None and producer.weights.announced == 5
    sent_at_swap = producer.writer.sent
    wait_for(lambda: producer.writer.sent >= sent_at_swap + 8, 60)
    producer.stop()
    th.join(60)
    assert producer.weights is not None and producer.weights.accepted == 1

    records = read_all(kafka, namespace, producer.writer.sent)
    new = [r.trajectory for r in records if r.trajectory.max_version == 5]
    assert new, "no trajectory carries the new policy version"
    # tokens sampled by version 5 have the new model's log-probabilities
    t = new[-1]
    full = np.asarray(token_logprobs(new_model, jnp.asarray([t.tokens.tolist()]))[0])
    for span in t.version_spans:
        if span.version == 5:
            idx = [i for i in range(span.start, span.end) if t.loss_mask[i]]
            np.testing.assert_allclose(t.logprobs[idx], full[idx], atol=1e-4)


def test_bad_announcements_are_refused_and_old_weights_stay(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 1))
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    producer = RolloutProducer(producer_config(namespace, checkpoint_roots=(root,)), kafka)
    th = run_in_thread(producer)
    wait_for(lambda: producer.writer.sent >= 4)
    model = init_model(CFG, seed=7)
    good = save_params(root / "v3", model)
    elsewhere = save_params(outside / "v3", model)
    p = kafka.producer()
    tampered = announcement(3, 3, good, CFG, TOKENIZER_ID, "t")
    tampered["digest"] = "sha256:" + "0" * 64
    announce(p, namespace, tampered)
    announce(p, namespace, announcement(4, 4, elsewhere, CFG, TOKENIZER_ID, "t"))
    escaping = announcement(5, 5, good, CFG, TOKENIZER_ID, "t")
    escaping["checkpoint_uri"] = str(root / ".." / "outside" / "v3")
    escaping["digest"] = announcement(5, 5, elsewhere, CFG, TOKENIZER_ID, "t")["digest"]
    announce(p, namespace, escaping)
    other_model = announcement(6, 6, good, ModelConfig(), TOKENIZER_ID, "t")
    announce(p, namespace, other_model)
    assert producer.weights is not None
    wait_for(lambda: sum(producer.weights.refused.values()) >= 4)  # type: ignore[union-attr]
    producer.stop()
    th.join(60)
    assert producer.version == 0
    assert producer.weights.refused == {"digest": 1, "uri": 2, "model_config": 1}
    # none of them counts as a version the trainer is ahead by (admission is not held)
    assert producer.weights.announced == 0


def test_admission_control_pauses_until_the_trainer_catches_up(
    kafka: KafkaConfig, namespace: str
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 1))
    # budget: 2 steps of 4 = two groups of 4 outstanding (unread by the trainer or in flight)
    adm = AdmissionConfig(max_staleness=2, trainer_batch=4, poll_s=0.2)
    producer = RolloutProducer(producer_config(namespace, admission=adm, concurrency=4), kafka)
    th = run_in_thread(producer)
    wait_for(lambda: producer.gate.paused, 60)
    time.sleep(2.0)
    started_while_paused = producer.stats.started
    time.sleep(2.0)
    assert producer.gate.paused
    assert producer.stats.started == started_while_paused  # nothing starts while paused
    # the "trainer" commits everything: lag drains, production resumes
    topic = rollout_topic(namespace, "guess")
    trainer = kafka.consumer(f"{namespace}.trainer")
    _, high = trainer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
    trainer.commit(offsets=[TopicPartition(topic, 0, high)], asynchronous=False)
    trainer.close()
    wait_for(lambda: producer.stats.started >= started_while_paused + 8, 30)
    producer.stop()
    th.join(60)
    # held back at least the four seconds above, by its own clock
    assert 3.5 <= producer.paused_seconds() < producer.running_seconds()


def test_sigterm_finishes_in_flight_work_and_flushes(bootstrap: str, namespace: str) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "produce",
            "--bootstrap",
            bootstrap,
            "--namespace",
            namespace,
            "--env",
            "guess",
            "--concurrency",
            "8",
            "--group-size",
            "4",
            "--latency-ms",
            "50",
            "--max-staleness",
            "-1",
            "--grace-s",
            "10",
            "--checkpoint-root",
            "none",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "RLSTREAM_CHECKPOINT_ROOT"},
    )
    deadline = time.monotonic() + 90
    assert proc.stdout is not None
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith("episodes=") and int(line.split()[0].split("=")[1]) >= 8:
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "--checkpoint-root none: this producer samples its initial policy" in err
    figures = json.loads(out.strip().splitlines()[-1])["figures"]
    assert figures["sent"] == figures["delivered"] == figures["episodes"]
    assert figures["delivery_failed"] == 0
    got = read_all(KafkaConfig(bootstrap=bootstrap), namespace, figures["delivered"])
    assert len({r.trajectory.trajectory_id for r in got}) == figures["delivered"]


def test_announced_adapters_are_applied_on_a_base_loaded_once(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    from flax import nnx

    from pipeline.policy.checkpoint import digest
    from pipeline.policy.config import LoRAConfig
    from pipeline.policy.lora import init_adapters, merged, save_adapters

    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 1))
    producer = RolloutProducer(producer_config(namespace, checkpoint_roots=(tmp_path,)), kafka)
    th = run_in_thread(producer)
    wait_for(lambda: producer.writer.sent >= 4)
    base_model = init_model(CFG, seed=11)
    base = save_params(tmp_path / "base", base_model, 0)
    lora = LoRAConfig(rank=2, alpha=4.0)
    p = kafka.producer()

    def adapters_of(version: int) -> dict:
        rng = np.random.default_rng(version)
        fresh = init_adapters(CFG, lora, version)
        return {
            k: {"a": v["a"], "b": rng.normal(0, 0.3, v["b"].shape).astype(np.float32)}
            for k, v in fresh.items()
        }

    def publish(version: int, base_digest: str) -> None:
        path = save_adapters(
            tmp_path / f"v{version}", adapters_of(version), version, CFG, lora, base, base_digest
        )
        record = announcement(version, version, path, CFG, TOKENIZER_ID, "trainer")
        record["format"] = "orbax-lora"
        announce(p, namespace, record)

    publish(2, "sha256:" + "0" * 64)  # a base whose digest does not match: refused
    assert producer.weights is not None
    wait_for(lambda: producer.weights.refused["digest"] == 1)  # type: ignore[union-attr]
    publish(3, digest(base))
    wait_for(lambda: producer.version == 3)
    loaded_base = producer.weights._base
    publish(4, digest(base))
    wait_for(lambda: producer.version == 4)
    assert producer.weights._base is loaded_base  # the base was not read again
    # the cached base's digest does not vouch for a base URI the roots refuse
    path = save_adapters(
        tmp_path / "v5", adapters_of(5), 5, CFG, lora, Path(f"{base}\x00x"), digest(base)
    )
    record = announcement(5, 5, path, CFG, TOKENIZER_ID, "trainer")
    record["format"] = "orbax-lora"
    announce(p, namespace, record)
    wait_for(lambda: producer.weights.refused["uri"] == 1)  # type: ignore[union-attr]
    assert producer.version == 4
    sent_at_swap = producer.writer.sent
    wait_for(lambda: producer.writer.sent >= sent_at_swap + 8, 60)
    producer.stop()
    th.join(60)
    assert producer.weights.accepted == 2 and producer.version == 4

    graphdef, params = nnx.split(base_model)
    policy = nnx.merge(graphdef, merged(params, adapters_of(4), lora.scale))
    records = read_all(kafka, namespace, producer.writer.sent)
    new = [r.trajectory for r in records if r.trajectory.max_version == 4]
    assert new, "no trajectory carries version 4"
    t = new[-1]
    full = np.asarray(token_logprobs(policy, jnp.asarray([t.tokens.tolist()]))[0])
    base_logp = np.asarray(token_logprobs(base_model, jnp.asarray([t.tokens.tolist()]))[0])
    checked = 0
    for span in t.version_spans:
        if span.version == 4:
            idx = [i for i in range(span.start, span.end) if t.loss_mask[i]]
            np.testing.assert_allclose(t.logprobs[idx], full[idx], atol=1e-4)
            assert np.abs(base_logp[idx] - full[idx]).max() > 1e-3  # the adapters matter
            checked += len(idx)
    assert checked


def test_episodes_certain_to_arrive_too_stale_are_aborted_and_free_their_slots(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    """``admission.abort_stale``: once the producer has loaded weights more than
    ``max_staleness`` versions newer than an episode's first token, the episode ends at
    once (no record: the trainer would drop it), its slot samples with the new weights,
    and nothing is left counted in flight."""
    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 1))
    cfg = producer_config(
        namespace,
        checkpoint_roots=(tmp_path,),
        latency_ms=300.0,  # every environment call: multi-turn episodes of seconds
        latency_sigma=0.1,
        admission=AdmissionConfig(max_staleness=1, trainer_batch=100_000, abort_stale=True),
    )
    producer = RolloutProducer(cfg, kafka)
    th = run_in_thread(producer)
    wait_for(lambda: producer.writer.sent >= 4, 120)
    path = save_params(tmp_path / "v2", init_model(CFG, seed=42))
    announce(kafka.producer(), namespace, announcement(2, 2, path, CFG, TOKENIZER_ID, "t"))
    wait_for(lambda: producer.version == 2, 60)
    swapped_ms = time.time() * 1000
    sent_at_swap = producer.writer.sent
    wait_for(lambda: producer.writer.sent >= sent_at_swap + 8, 120)
    producer.stop()
    th.join(60)
    assert not th.is_alive()

    st = producer.stats
    assert st.aborted_stale >= 1, "no episode in flight was aborted at the swap"
    assert producer.in_flight == 0
    assert status_line(producer)["aborted_stale"] == st.aborted_stale
    # an aborted episode writes nothing; every finished one wrote its record
    assert producer.writer.sent == sum(st.finished.values())
    records = [r.trajectory for r in read_all(kafka, namespace, producer.writer.sent)]
    # what sampled its first token with version 0 ended before the swap (up to the time
    # the test took to see it), never after it
    late = [
        t.timings.finished_at_ms - swapped_ms
        for t in records
        if t.min_version == 0 and t.timings.finished_at_ms > swapped_ms + 500
    ]
    assert not late, f"records of version 0 finished after the swap: {late}"
    assert any(t.min_version == 2 for t in records)
