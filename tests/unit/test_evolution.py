"""Schema evolution both ways, following Avro's resolution rules: a field added with a
default is filled in for old records and ignored by old readers."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from pipeline.errors import RecordDecodeError
from pipeline.records.codec import AvroCodec, TrajectoryCodec
from pipeline.records.schema_store import Schema, SchemaStore, default_store, parse
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
