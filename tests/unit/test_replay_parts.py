"""Recording bounds and filters, and a recording read by the trainer's source."""

from __future__ import annotations

from pathlib import Path

import fastavro
import pytest

from pipeline.errors import RlstreamError
from pipeline.kafka.replay import (
    Recorded,
    RecordingError,
    RecordingSource,
    parse_bound,
    read_recording,
    recording_schema,
)
from pipeline.observe.recording import parse_filter
from pipeline.records.codec import to_avro_dict
from pipeline.testing import make_trajectory


def test_bounds_are_offsets_epoch_millis_or_iso_times() -> None:
    assert parse_bound("42") == ("offset", 42)
    assert parse_bound("ms:1700000000000") == ("time", 1700000000000)
    assert parse_bound("2026-11-30T01:00:00") == ("time", 1796000400000)
    assert parse_bound("2026-11-30T02:00:00+01:00") == ("time", 1796000400000)
    assert parse_bound(None) is None
    with pytest.raises(RlstreamError, match="neither an offset"):
        parse_bound("yesterday")


def test_filters_combine_and_reject_unknown_keys() -> None:
    ok = Recorded(
        "ns.rollouts.guess", 0, 1, 0, trajectory=make_trajectory(16, env="guess", reward=1.0)
    )
    bad = Recorded("ns.rollouts.calc", 0, 2, 0, raw=b"x", error="truncated: x")
    keep = parse_filter("env=guess,min_reward=0.5")
    assert keep(ok) and not keep(bad)
    assert parse_filter("decodable=false")(bad) and not parse_filter("decodable=false")(ok)
    assert parse_filter("env=calc")(bad)  # the topic names the env of an undecodable one
    assert parse_filter(None)(bad)
    with pytest.raises(RlstreamError, match="unknown filter"):
        parse_filter("colour=red")
    with pytest.raises(RlstreamError, match="needs a number"):
        parse_filter("min_reward=high")


def _write(path: Path, n: int) -> None:
    rows = [
        {
            "topic": "ns.rollouts.synthetic",
            "partition": 0,
            "offset": i,
            "timestamp_ms": 1000 + i,
            "key": b"g",
            "headers": {},
            "trajectory": to_avro_dict(make_trajectory(32, group_id="g", turns=2)),
            "raw": None,
            "error": None,
        }
        for i in range(n)
    ]
    with path.open("wb") as f:
        fastavro.writer(f, recording_schema(), rows, codec="deflate", sync_interval=1000)


def test_not_a_recording_and_a_missing_one_say_so(tmp_path: Path) -> None:
    junk = tmp_path / "junk.avro"
    junk.write_bytes(b"hello")
    with pytest.raises(RecordingError, match="not an rlstream recording"):
        list(read_recording(junk))
    with pytest.raises(RecordingError, match="cannot open"):
        list(read_recording(tmp_path / "missing.avro"))


def test_the_source_serves_the_file_in_order_then_is_exhausted(tmp_path: Path) -> None:
    path = tmp_path / "r.avro"
    _write(path, 5)
    src = RecordingSource(path)
    assigned = []
    src.subscribe([], on_assign=lambda c, parts: assigned.extend(parts))
    first = src.consume(3)
    assert [m.offset for m in first] == [0, 1, 2] and len(assigned) == 1
    assert [m.offset for m in src.consume(10)] == [3, 4]
    assert src.exhausted and src.consume(10) == []
    assert src.get_watermark_offsets(assigned[0]) == (0, 5)
    assert first[0].timestamp_ms == 1000 and first[0].key == b"g"


def test_a_deflate_bomb_is_refused_without_inflating_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block whose deflate data inflates past the bound (here 1 MiB, 64 MiB in use) is
    refused as damaged; the blocks before it are read."""
    import resource
    import zlib

    from pipeline.records import container

    monkeypatch.setattr(container, "MAX_BLOCK_BYTES", 1 << 20)
    path = tmp_path / "r.avro"
    _write(path, 3)
    good = path.read_bytes()
    with path.open("rb") as f:
        header = fastavro.schemaless_reader(f, fastavro.read.HEADER_SCHEMA)
    sync = header["sync"]  # type: ignore[index,call-overload]
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    bomb = packer.compress(b"\0" * (64 << 20)) + packer.flush()  # 64 MiB in about 64 KB

    def long(n: int) -> bytes:
        n = (n << 1) ^ (n >> 63)
        out = bytearray()
        while n > 0x7F:
            out.append(n & 0x7F | 0x80)
            n >>= 7
        return bytes([*out, n])

    path.write_bytes(good + long(1) + long(len(bomb)) + bomb + sync)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got = []
    with pytest.raises(RecordingError, match=r"block \d+ .* inflates to more than 1 MiB"):
        for r in read_recording(path):
            got.append(r)
    assert len(got) == 3
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 32 << 10  # KiB
