"""Schema evolution both ways, following Avro's resolution rules: a field added with a
default is filled in for old records and ignored by old readers."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import RecordDecodeError
from pipeline.records.codec import AvroCodec, TrajectoryCodec, to_avro_dict
from pipeline.records.schema_store import (
    Schema,
    SchemaStore,
    default_store,
    expand_references,
    history,
    load_schema_json,
    parse,
)
from pipeline.records.trajectory import Trajectory, Turn, Turns
from pipeline.testing import make_trajectory


def _current() -> dict:
    return json.loads(default_store().reader("Trajectory").canonical_form)


def _newer() -> Schema:
    """The next version: one more field, with a default."""
    s = _current()
    s["fields"].append({"name": "sandbox_id", "type": "string", "default": "none"})
    return parse(s)


def _older() -> Schema:
    """The previous version: without the ``metadata`` field (which has a default now)."""
    s = _current()
    s["fields"] = [f for f in s["fields"] if f["name"] != "metadata"]
    return parse(s)


def test_versions_have_distinct_fingerprints() -> None:
    fps = {
        default_store().reader("Trajectory").fingerprint,
        _newer().fingerprint,
        _older().fingerprint,
    }
    assert len(fps) == 3


def test_old_writer_new_reader_fills_defaults() -> None:
    old_store = SchemaStore()
    old_store.use_reader(_older())
    t = make_trajectory(32, rng=np.random.default_rng(0))
    from pipeline.records.codec import to_avro_dict

    d = to_avro_dict(t)
    del d["metadata"]
    data = AvroCodec("Trajectory", old_store).encode(d)
    assert data[2:10] == _older().fingerprint

    store = SchemaStore()
    store.register(_older())
    back = TrajectoryCodec(store).decode(data)
    assert back.metadata == {}
    assert back.tokens.tobytes() == t.tokens.tobytes()
    assert back.trajectory_id == t.trajectory_id


def test_new_writer_old_reader_ignores_new_field() -> None:
    new_store = SchemaStore()
    new_store.use_reader(_newer())
    from pipeline.records.codec import to_avro_dict

    t = make_trajectory(32, rng=np.random.default_rng(1))
    d = to_avro_dict(t)
    d["sandbox_id"] = "sbx-7"
    data = AvroCodec("Trajectory", new_store).encode(d)

    # today's reader, which knows the newer writer schema
    store = SchemaStore()
    store.register(_newer())
    back = TrajectoryCodec(store).decode(data)
    assert back.trajectory_id == t.trajectory_id
    assert back.logprobs.tobytes() == t.logprobs.tobytes()

    # and an old reader (no metadata field) reading a current record
    old_store = SchemaStore()
    old_store.use_reader(_older())
    old_store.register(default_store().reader("Trajectory"))
    current = TrajectoryCodec().encode(t)
    old_view = AvroCodec("Trajectory", old_store).decode(current)
    assert "metadata" not in old_view
    assert old_view["group_id"] == t.group_id


def test_unknown_writer_version_is_refused() -> None:
    new_store = SchemaStore()
    new_store.use_reader(_newer())
    from pipeline.records.codec import to_avro_dict

    d = to_avro_dict(make_trajectory(8))
    d["sandbox_id"] = "x"
    data = AvroCodec("Trajectory", new_store).encode(d)
    with pytest.raises(RecordDecodeError) as e:
        TrajectoryCodec().decode(data)  # never told about the newer schema
    assert e.value.reason == "unknown_schema"


def test_new_enum_symbol_unknown_to_old_reader() -> None:
    s = _current()
    s = copy.deepcopy(s)
    for f in s["fields"]:
        if f["name"] == "status":
            f["type"]["symbols"] = [*f["type"]["symbols"], "cancelled"]
    newer = parse(s)
    new_store = SchemaStore()
    new_store.use_reader(newer)
    from pipeline.records.codec import to_avro_dict

    d = to_avro_dict(make_trajectory(8))
    d["status"] = "cancelled"
    data = AvroCodec("Trajectory", new_store).encode(d)
    store = SchemaStore()
    store.register(newer)
    with pytest.raises(RecordDecodeError) as e:
        TrajectoryCodec(store).decode(data)
    assert e.value.reason == "bad_enum"
    # a known symbol from the same newer writer still reads
    d["status"] = "timeout"
    assert (
        TrajectoryCodec(store).decode(AvroCodec("Trajectory", new_store).encode(d)).status
        == "timeout"
    )


# ---- version 1 (turns as records) and version 2 (turns as columns) -------------------


def _v1() -> Schema:
    (v1,) = history("Trajectory")
    return v1


def _v1_value(t: Trajectory) -> dict:
    """``t`` as the plain Avro value of a version-1 record."""
    from pipeline.records.codec import to_avro_dict

    d = to_avro_dict(t)
    for name in [k for k in d if k.startswith("turn_")]:
        del d[name]
    d["turns"] = [turn._asdict() for turn in t.turns]
    return d


def _turny(seed: int) -> Trajectory:
    t = make_trajectory(64, rng=np.random.default_rng(seed), turns=6)
    t.turns = Turns.of(
        [
            turn._replace(tool_name="calc" if i == 3 else "", latency_s=0.25 * i)
            for i, turn in enumerate(t.turns)
        ]
    )
    return t


def _same(a: Trajectory, b: Trajectory) -> None:
    for f in dataclasses.fields(Trajectory):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), f.name
        elif isinstance(x, (list, tuple, Turns)):
            assert list(x) == list(y), f.name
        else:
            assert x == y, f.name


def test_version_2_holds_turns_as_columns_and_keeps_reading_version_1() -> None:
    v1, v2 = _v1(), default_store().reader("Trajectory")
    assert v1.fingerprint != v2.fingerprint and default_store().writer(v1.fingerprint) == v1
    t = _turny(0)
    old_store = SchemaStore()
    old_store.use_reader(v1)
    old = AvroCodec("Trajectory", old_store).encode(_v1_value(t))
    assert old[2:10] == v1.fingerprint
    back = TrajectoryCodec().decode(old)
    assert isinstance(back.turns, Turns)
    _same(back, t)
    assert back.turns[3] == Turn("assistant", *t.turns[3][1:3], "calc", 0.75)

    # and the other way: a version-1 reader takes a version-2 record, its turns empty
    old_store.register(v2)
    view = AvroCodec("Trajectory", old_store).decode(TrajectoryCodec().encode(t))
    assert view["turns"] == [] and view["trajectory_id"] == t.trajectory_id
    assert view["tokens"]["data"] == t.tokens.tobytes()


def test_apache_avro_resolves_the_two_versions_both_ways() -> None:
    """The reference implementation agrees that version 2 is a legal evolution of 1."""
    import avro.io
    import avro.schema

    v1, v2 = _v1(), default_store().reader("Trajectory")
    s1, s2 = avro.schema.parse(v1.text), avro.schema.parse(v2.text)
    t = _turny(1)
    old_store = SchemaStore()
    old_store.use_reader(v1)
    body_v1 = AvroCodec("Trajectory", old_store).encode(_v1_value(t))[10:]
    body_v2 = TrajectoryCodec().encode(t)[10:]
    new_view = avro.io.DatumReader(s1, s2).read(avro.io.BinaryDecoder(io.BytesIO(body_v1)))
    assert new_view["turns"] == [turn._asdict() for turn in t.turns]
    assert new_view["turn_roles"]["shape"] == [0] and new_view["turn_tool_names"] == []
    old_view = avro.io.DatumReader(s2, s1).read(avro.io.BinaryDecoder(io.BytesIO(body_v2)))
    assert old_view["turns"] == [] and old_view["reward"] == t.reward
    own = avro.io.DatumReader(s2, s2).read(avro.io.BinaryDecoder(io.BytesIO(body_v2)))
    assert own["turn_roles"]["data"] == t.turns.roles.tobytes()
    assert own["turn_starts"]["data"] == t.turns.starts.tobytes()
    assert own["turn_tool_names"] == ["", "", "", "calc", "", ""]


def test_turns_given_twice_are_refused() -> None:
    t = _turny(2)
    d = to_avro_dict(t)
    d["turns"] = [turn._asdict() for turn in t.turns]
    with pytest.raises(RecordDecodeError) as e:
        TrajectoryCodec().decode(TrajectoryCodec().encode_avro_dict(d))
    assert e.value.reason == "invalid" and "both as records and as columns" in str(e.value)


def test_a_version_1_recording_still_reads(tmp_path: Path) -> None:
    import fastavro

    from pipeline.kafka.replay import read_recording

    raw = load_schema_json("RecordedTrajectory")
    definitions = {
        "rlstream.Tensor": load_schema_json("Tensor"),
        "rlstream.Trajectory": load_schema_json("Trajectory.v1"),
    }
    schema = fastavro.parse_schema(expand_references(raw, definitions))
    t = _turny(3)
    row = {
        "topic": "ns.rollouts.guess",
        "partition": 0,
        "offset": 7,
        "timestamp_ms": 1,
        "key": b"g",
        "headers": {},
        "trajectory": _v1_value(t),
        "raw": None,
        "error": None,
    }
    path = tmp_path / "old.avro"
    with path.open("wb") as f:
        fastavro.writer(f, schema, [row])
    (got,) = list(read_recording(path))
    assert got.trajectory is not None
    _same(got.trajectory, t)
