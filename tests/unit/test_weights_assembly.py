"""Assembling a sending of checkpoint chunks (``pipeline.kafka.weights_data._Assembly``)
without a broker: its writer thread's failures reach the caller and never leave it
waiting. The sending through a real broker, and every hostile sending, are in
tests/integration/test_weights_cluster.py."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from pipeline.kafka.weights_data import Refusal, _Assembly
from pipeline.policy.checkpoint import digest
from pipeline.records.codec import shared_codec
from pipeline.testing import weights_chunks

FILES = {"a.bin": bytes(range(256)) * 40, "d/b.bin": b"x" * 9000}


def _values(piece: int = 1000) -> list[bytes]:
    codec = shared_codec("WeightsChunk")
    return [codec.encode(c) for c in weights_chunks(FILES, "t", 2, piece)]


def _assembly(into: Path, chunks: int) -> _Assembly:
    into.mkdir()
    return _Assembly(into, "t", 2, chunks, sum(len(d) for d in FILES.values()))


def test_the_files_and_their_digest_come_out_whole(tmp_path: Path) -> None:
    values = _values()
    a = _assembly(tmp_path / "got", len(values))
    try:
        for v in values:
            a.take(v)
        got = a.finish()
    finally:
        a.close()
    assert got == digest(tmp_path / "got")
    for rel, data in FILES.items():
        assert (tmp_path / "got" / rel).read_bytes() == data


def test_a_failure_on_the_writer_thread_is_raised_and_never_leaves_the_caller_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error the writer did not expect (here every write fails) is a refusal, and
    the caller may go on handing it chunks (more than it queues) without blocking."""

    def broken(self: _Assembly, step: tuple[Any, ...]) -> None:
        raise RuntimeError("the disk went away")

    monkeypatch.setattr(_Assembly, "_write", broken)
    values = _values(piece=100)  # more chunks than the queue holds
    assert len(values) > 2 * _Assembly.AHEAD
    a = _assembly(tmp_path / "got", len(values))
    outcome: list[BaseException] = []

    def feed() -> None:
        try:
            for v in values:
                a.take(v)
            a.finish()
        except BaseException as e:  # the outcome is what is checked
            outcome.append(e)
        finally:
            a.close()

    th = threading.Thread(target=feed, daemon=True)
    th.start()
    th.join(30)
    assert not th.is_alive(), "the caller was left waiting on the writer"
    assert isinstance(outcome[0], Refusal) and outcome[0].reason == "file"
    assert "the disk went away" in outcome[0].detail


def test_a_chunk_that_does_not_hash_to_its_sha256_is_refused_by_name(tmp_path: Path) -> None:
    values = _values()
    codec = shared_codec("WeightsChunk")
    spoilt = codec.decode(values[3])
    spoilt["data"] = b"y" * len(spoilt["data"])
    values[3] = codec.encode(spoilt)
    a = _assembly(tmp_path / "got", len(values))
    with pytest.raises(Refusal) as refused:
        try:
            for v in values:
                a.take(v)
            a.finish()
        finally:
            a.close()
    assert refused.value.reason == "chunk_digest" and "chunk 3" in refused.value.detail
