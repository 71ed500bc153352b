"""Checkpoints through the cluster (``<ns>.weights-data``) on the real broker: a producer
that cannot read the trainer's folder loads every version from the chunks the trainer
sent, bit for bit; a hostile sending (a chunk that lies about its bytes, a file name that
leaves the folder, a missing, foreign or reordered chunk, a range of another topic, more
bytes than announced, bytes that are no record) is refused with its reason, and nothing
of it is loaded or written outside the private folder."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.kafka import weights_data
from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import ensure_topics, namespace_topics, weights_data_topic
from pipeline.kafka.weights import WeightsSubscriber
from pipeline.kafka.weights_data import Refusal, fetch_checkpoint, send_checkpoint
from pipeline.policy.checkpoint import digest, restore_params, save_params
from pipeline.policy.model import init_model
from pipeline.policy.tokenizer import TOKENIZER_ID
from pipeline.records.codec import AvroCodec
from pipeline.rollout.producer import RolloutProducer
from pipeline.testing import weights_chunks
from pipeline.train import publish
from pipeline.train.config import TrainerConfig
from pipeline.train.publish import WeightsPublisher
from tests.integration.test_producer import CFG, producer_config, run_in_thread, wait_for

pytestmark = [pytest.mark.integration]


def _params(tree: Any) -> list[np.ndarray]:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_a_checkpoint_travels_through_the_cluster_bit_for_bit(
    kafka: KafkaConfig, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 1))
    monkeypatch.setattr(weights_data, "CHUNK_BYTES", 4096)  # many chunks, files split
    model = init_model(CFG, 3)
    path = save_params(tmp_path / "v3", model, version=3)
    files = [p for p in path.rglob("*") if p.is_file()]
    sent, transfer = send_checkpoint(kafka.producer(), namespace, path, 3)
    assert sent == digest(path)
    assert transfer["bytes"] == sum(p.stat().st_size for p in files)
    assert transfer["chunks"] > len(files) and transfer["topic"] == weights_data_topic(namespace)
    got = fetch_checkpoint(kafka, namespace, transfer, 3, tmp_path / "got")
    assert got == sent == digest(tmp_path / "got")
    for p in files:
        assert (tmp_path / "got" / p.relative_to(path)).read_bytes() == p.read_bytes()
    restored = restore_params(tmp_path / "got", CFG)
    original = restore_params(path, CFG)
    for a, b in zip(_params(restored), _params(original), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


# A small checkpoint of three chunks: the file "a" (10 bytes), then "d/b" in two pieces.
_FILES = {"a": b"0123456789", "d/b": bytes(range(256)) * 20}


def _chunks(transfer_id: str, version: int = 5) -> list[dict[str, Any]]:
    return weights_chunks(_FILES, transfer_id, version, 4096)


def _send(kafka: KafkaConfig, namespace: str, values: list[bytes]) -> list[int]:
    producer = kafka.producer()
    offsets: list[int] = []
    for i, value in enumerate(values):
        producer.produce(
            weights_data_topic(namespace),
            value,
            f"v/{i}".encode(),
            partition=0,
            on_delivery=lambda err, msg: offsets.append(msg.offset()),
        )
    assert producer.flush(30) == 0
    return offsets


def _renumber(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [dict(c, index=i) for i, c in enumerate(chunks)]


def _swap_files(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return _renumber(chunks[1:] + chunks[:1])


def _lie(chunk: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return dict(chunk, **kw)


def _first(**kw: Any) -> Callable[[list[Any]], list[Any]]:
    return lambda c: [_lie(c[0], **kw), *c[1:]]


def _second(**kw: Any) -> Callable[[list[Any]], list[Any]]:
    return lambda c: [c[0], _lie(c[1], **kw), *c[2:]]


# name, how the chunks are spoiled, how the announced transfer is, the reason expected
HOSTILE: list[tuple[str, Callable[[list[Any]], list[Any]], dict[str, Any], str]] = [
    (
        "bytes_not_their_sha256",
        _second(data=b"x" * 4096),
        {},
        "chunk_digest",
    ),
    ("a_file_out_of_the_folder", _first(file="../evil"), {}, "file"),
    ("an_absolute_file", _first(file="/tmp/evil"), {}, "file"),
    ("a_file_through_dotdot", _first(file="d/../../evil"), {}, "file"),
    ("a_missing_chunk", lambda c: [c[0], c[2]], {}, "incomplete"),
    ("files_out_of_order", _swap_files, {}, "order"),
    ("a_piece_out_of_place", lambda c: [c[0], c[2], c[1]], {}, "incomplete"),
    (
        "a_file_longer_than_it_says",
        _first(file_size=5),
        {},
        "too_large",
    ),
    ("more_bytes_than_announced", lambda c: c, {"bytes": 100}, "too_large"),
    ("fewer_bytes_than_announced", lambda c: c, {"bytes": 10**6}, "incomplete"),
    (
        "a_chunk_of_another_version",
        _second(policy_version=4),
        {},
        "version",
    ),
    ("bytes_that_are_no_record", lambda c: [c[0], b"\xc3\x01garbage", c[2]], {}, "undecodable"),
    ("a_range_past_the_end", lambda c: c, {"chunks": 9, "last_offset": 10**6}, "incomplete"),
    ("another_namespace_s_topic", lambda c: c, {"topic": "other.weights-data"}, "transfer"),
    ("another_partition", lambda c: c, {"partition": 3}, "transfer"),
    ("a_range_too_short_for_its_chunks", lambda c: c, {"chunks": 50, "last_offset": 2}, "transfer"),
    ("a_file_beneath_a_file", lambda c: [c[0], *(_lie(x, file="a/b") for x in c[1:])], {}, "file"),
    ("a_transfer_that_is_no_transfer", lambda c: c, {"first_offset": "x"}, "transfer"),
]


@pytest.mark.parametrize(
    ("spoil", "announced", "reason"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE]
)
def test_a_hostile_sending_is_refused_with_its_reason(
    kafka: KafkaConfig,
    namespace: str,
    tmp_path: Path,
    spoil: Callable[[list[Any]], list[Any]],
    announced: dict[str, Any],
    reason: str,
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 1))
    codec = AvroCodec("WeightsChunk")
    good = _chunks("t1")
    values = [c if isinstance(c, bytes) else codec.encode(c) for c in spoil(good)]
    offsets = _send(kafka, namespace, values)
    assert offsets[0] == 0  # a fresh topic: the cases' offsets are absolute
    transfer = {
        "transfer_id": "t1",
        "topic": weights_data_topic(namespace),
        "partition": 0,
        "first_offset": 0,
        "last_offset": len(good) - 1,
        "chunks": len(good),
        "bytes": sum(len(d) for d in _FILES.values()),
        **announced,
    }
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(Refusal) as refused:
        fetch_checkpoint(kafka, namespace, transfer, 5, work / "got", timeout=30)
    assert refused.value.reason == reason, refused.value.detail
    # nothing was written beside the private folder
    assert [p.name for p in work.iterdir()] in ([], ["got"])
    assert not (tmp_path / "evil").exists() and not Path("/tmp/evil").exists()


def test_the_sending_as_it_is_sent_is_read_back_and_another_sending_in_its_range_is_skipped(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    """The control of the cases above: the same chunks unspoiled load, even with a chunk
    of another sending (a second trainer, a retry) between them."""
    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 1))
    codec = AvroCodec("WeightsChunk")
    good, other = _chunks("t1"), _chunks("t2")
    offsets = _send(kafka, namespace, [codec.encode(c) for c in [good[0], other[0], *good[1:]]])
    transfer = {
        "transfer_id": "t1",
        "topic": weights_data_topic(namespace),
        "partition": 0,
        "first_offset": offsets[0],
        "last_offset": offsets[-1],
        "chunks": 3,
        "bytes": sum(len(d) for d in _FILES.values()),
    }
    got = fetch_checkpoint(kafka, namespace, transfer, 5, tmp_path / "got", timeout=30)
    for rel, data in _FILES.items():
        assert (tmp_path / "got" / rel).read_bytes() == data
    assert got == digest(tmp_path / "got")


def test_a_producer_that_cannot_read_the_trainer_s_folder_loads_from_the_cluster(
    kafka: KafkaConfig, namespace: str, tmp_path: Path
) -> None:
    """The trainer's publisher saves and sends versions 1 and 2; a producer whose
    checkpoint root is a folder of its own loads both through the cluster (auto), bit for
    bit; a producer that may read only folders refuses them, naming why."""
    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 1))
    trainer_dir, own = tmp_path / "trainer", tmp_path / "own"
    own.mkdir()
    cfg = TrainerConfig(namespace=namespace, run_dir=trainer_dir, model=CFG, keep_checkpoints=1)
    publisher = WeightsPublisher(
        cfg, kafka.producer(), TOKENIZER_ID, data_producer=kafka.producer()
    )
    producer = RolloutProducer(producer_config(namespace, checkpoint_roots=(own,)), kafka)
    th = run_in_thread(producer)
    loaded: dict[str, list[tuple[int, Any]]] = {"auto": [], "directory": []}
    subscribers = [
        WeightsSubscriber(
            kafka,
            namespace,
            CFG,
            TOKENIZER_ID,
            [own],
            lambda p, v, s=source: loaded[s].append((v, p)),
            source=source,
        ).start()
        for source in loaded
    ]
    try:
        models = {v: init_model(CFG, 10 + v) for v in (1, 2)}
        for v, model in models.items():
            publisher.publish(v, v, lambda m=model: m, {"loss": 0.5})
            wait_for(lambda v=v: producer.version == v, 60)
        weights = producer.weights
        assert weights is not None
        assert dict(weights.loaded_from) == {"cluster": 2} and not weights.refused
        # what came through the cluster is version 2 as the trainer saved it
        wait_for(lambda: [v for v, _ in loaded["auto"]] == [1, 2], 60)
        theirs = _params(restore_params(trainer_dir / "weights" / "v2", CFG))
        for a, b in zip(_params(loaded["auto"][-1][1]), theirs, strict=True):
            assert np.array_equal(a, b)
        # one that may read only folders refuses, naming why
        folders_only = subscribers[1]
        wait_for(lambda: folders_only.refused["uri"] >= 1, 30)
        assert loaded["directory"] == [] and folders_only.version == 0
    finally:
        for sub in subscribers:
            sub.stop()
        producer.stop()
        th.join(60)


def test_a_trainer_stopping_while_the_cluster_is_gone_gives_up_the_sending_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sending runs beside training; at a stop it may take what is left of the stop's
    budget, then gives up (one warning) instead of holding the trainer for its own
    timeout; nothing is announced."""
    gone = KafkaConfig(bootstrap="127.0.0.1:1", extra={"message.timeout.ms": "600000"})
    cfg = TrainerConfig(namespace="gone", run_dir=tmp_path, model=CFG)
    announced: list[Any] = []
    monkeypatch.setattr(publish, "announce", lambda *a, **kw: announced.append(a))
    announcer, sender = gone.producer(), gone.producer()
    publisher = WeightsPublisher(cfg, announcer, TOKENIZER_ID, data_producer=sender)
    t0 = time.monotonic()
    publisher.publish(1, 1, lambda: init_model(CFG, 1), {})
    assert time.monotonic() - t0 < 30  # saved; sending goes on beside
    assert (tmp_path / "weights" / "v1").is_dir() and not publisher.wait(1.0)
    t0 = time.monotonic()
    publisher.close(1.0)
    assert time.monotonic() - t0 < 5 and publisher.wait(0)
    assert announced == []
