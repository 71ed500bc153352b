from __future__ import annotations

import io
import json
import math
import pickle

import numpy as np
import pytest

from pipeline.errors import InvalidTrajectoryError, RecordDecodeError
from pipeline.records.codec import (
    MARKER,
    AvroCodec,
    TrajectoryCodec,
    TrajectoryHeaders,
    to_avro_dict,
)
from pipeline.records.schema_store import default_store
from pipeline.records.trajectory import Trajectory, Turn, VersionSpan
from pipeline.testing import make_trajectory


def assert_same(a: Trajectory, b: Trajectory) -> None:
    for name in Trajectory.__slots__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert x.tobytes() == y.tobytes(), name
        elif isinstance(x, list | tuple):
            assert list(x) == list(y), name
        else:
            assert x == y, name


@pytest.fixture
def codec() -> TrajectoryCodec:
    return TrajectoryCodec()


def test_round_trip_keeps_every_field(codec: TrajectoryCodec) -> None:
    t = make_trajectory(300, rng=np.random.default_rng(1), versions=(3, 4, 5), turns=5)
    data = codec.encode(t)
    assert data[:2] == MARKER and data[2:10] == codec.fingerprint
    back = codec.decode(data)
    assert_same(t, back)
    assert back.min_version == 3 and back.max_version == 5
    assert isinstance(back.turns[0], Turn) and isinstance(back.version_spans[0], VersionSpan)


def test_dataclass_fields_follow_schema_order() -> None:
    schema = json.loads(default_store().reader("Trajectory").canonical_form)
    fields = [f["name"] for f in schema["fields"] if not f["name"].startswith("turn_")]
    assert list(Trajectory.__slots__) == fields  # the turn_* columns are held by `turns`


def test_empty_trajectory_round_trips(codec: TrajectoryCodec) -> None:
    t = make_trajectory(0, turns=0, versions=())
    assert_same(t, codec.decode(codec.encode(t)))


def test_fingerprint_is_the_standard_crc64_of_the_full_schema() -> None:
    import avro.schema

    schema = default_store().reader("Trajectory")
    apache = avro.schema.parse(schema.canonical_form)
    assert apache.fingerprint("CRC-64-AVRO") == schema.fingerprint
    # the canonical form stands alone: Tensor is written out, not just named
    assert '"name":"rlstream.Tensor","type":"record"' in schema.canonical_form


def test_body_is_standard_avro_both_ways(codec: TrajectoryCodec) -> None:
    import avro.io
    import avro.schema

    t = make_trajectory(64, rng=np.random.default_rng(2), turns=4)
    data = codec.encode(t)
    schema = avro.schema.parse(default_store().reader("Trajectory").canonical_form)
    # rlstream -> Apache avro
    datum = avro.io.DatumReader(schema).read(avro.io.BinaryDecoder(io.BytesIO(data[10:])))
    expected = to_avro_dict(t)
    expected["tokens"]["shape"] = list(expected["tokens"]["shape"])
    for key in ("trajectory_id", "group_id", "env", "reward", "status", "metadata", "rewards"):
        assert datum[key] == expected[key]
    assert datum["tokens"]["data"] == t.tokens.tobytes()
    assert datum["turns"] == expected["turns"]
    assert datum["timings"] == expected["timings"]
    # Apache avro -> rlstream
    buf = io.BytesIO()
    avro.io.DatumWriter(schema).write(datum, avro.io.BinaryEncoder(buf))
    assert buf.getvalue() == data[10:]
    assert_same(t, codec.decode(MARKER + codec.fingerprint + buf.getvalue()))


def test_fastavro_reads_the_body(codec: TrajectoryCodec) -> None:
    from fastavro import schemaless_reader

    t = make_trajectory(32, rng=np.random.default_rng(3))
    data = codec.encode(t)
    datum = schemaless_reader(
        io.BytesIO(data[10:]), default_store().reader("Trajectory").parsed, None
    )
    assert datum["logprobs"]["data"] == t.logprobs.tobytes()
    assert datum["version_spans"] == [s._asdict() for s in t.version_spans]


def test_decoded_arrays_need_no_copy(codec: TrajectoryCodec) -> None:
    t = make_trajectory(4096)
    back = codec.decode(codec.encode(t))
    assert back.tokens.dtype == np.int32 and not back.tokens.flags.writeable
    assert back.tokens.base is not None  # a view over the record's bytes


def test_pickle_of_decoded_trajectory_works(codec: TrajectoryCodec) -> None:
    t = codec.decode(codec.encode(make_trajectory(16)))
    assert_same(t, pickle.loads(pickle.dumps(t)))


# ---- headers -------------------------------------------------------------------------


def test_headers_carry_what_filtering_needs(codec: TrajectoryCodec) -> None:
    t = make_trajectory(100, versions=(7, 9), env="math", group_id="g-1")
    h = TrajectoryHeaders.parse(codec.headers(t))
    assert h == TrajectoryHeaders(codec.fingerprint, "math", "g-1", 7, 9, 100)


def test_malformed_headers_read_as_missing() -> None:
    h = TrajectoryHeaders.parse(
        [
            ("rlstream.version.min", b"x1"),
            ("rlstream.env", b"\xff"),
            ("rlstream.schema", b"zz"),
            ("rlstream.tokens", None),
        ]
    )
    assert h == TrajectoryHeaders(None, None, None, None, None, None)
    assert TrajectoryHeaders.parse(None).min_version is None


# ---- encode refuses invalid trajectories ------------------------------------------------


def _with(t: Trajectory, **changes: object) -> Trajectory:
    values = {name: getattr(t, name) for name in Trajectory.__slots__}
    values.update(changes)
    return Trajectory(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"loss_mask": np.zeros(5, np.uint8)}, "length_mismatch"),
        ({"logprobs": np.zeros(3, np.float32)}, "length_mismatch"),
        ({"reward": math.nan}, "non_finite"),
        ({"reward": math.inf}, "non_finite"),
        ({"rewards": {"x": -math.inf}}, "non_finite"),
        ({"logprobs": np.full(10, np.nan, np.float32)}, "non_finite"),
        ({"status": "exploded"}, "bad_enum"),
        ({"turns": [Turn("wizard", 0, 1)]}, "bad_enum"),
        ({"version_spans": [VersionSpan(0, 99, 1)]}, "bad_span"),
        ({"version_spans": []}, "bad_span"),
        ({"turns": [Turn("user", 5, 6), Turn("assistant", 0, 5)]}, "bad_span"),
        ({"group_index": 4, "group_size": 4}, "invalid"),
        ({"tokens": np.zeros(10, np.int64)}, "invalid"),
        ({"loss_mask": np.full(10, 2, np.uint8)}, "invalid"),
    ],
)
def test_encode_refuses_contract_violations(
    codec: TrajectoryCodec, changes: dict[str, object], reason: str
) -> None:
    t = _with(make_trajectory(10, turns=2), **changes)
    with pytest.raises(InvalidTrajectoryError, match=reason):
        codec.encode(t)


# ---- decode refuses bad bytes ---------------------------------------------------------------


def _raw(datum: dict[str, object]) -> bytes:
    """Encode an Avro value without the trajectory checks (to build corrupt records)."""
    return AvroCodec("Trajectory").encode(datum)


@pytest.fixture
def good() -> bytes:
    return TrajectoryCodec().encode(make_trajectory(64, rng=np.random.default_rng(5), turns=4))


def _reason(codec: TrajectoryCodec, data: bytes) -> str:
    with pytest.raises(RecordDecodeError) as e:
        codec.decode(data)
    return e.value.reason


def test_truncated_bytes(codec: TrajectoryCodec, good: bytes) -> None:
    for cut in (1, 5, 9, 10, 11, 40, len(good) // 2, len(good) - 1):
        assert _reason(codec, good[:cut]) in ("truncated", "bad_length"), cut
    assert _reason(codec, good[:5]) == "truncated"
    assert _reason(codec, good[: len(good) - 1]) == "truncated"


def test_wrong_marker_and_trailing_bytes(codec: TrajectoryCodec, good: bytes) -> None:
    assert _reason(codec, b"") == "bad_marker"
    assert _reason(codec, b"\x01\x01" + good[2:]) == "bad_marker"
    assert _reason(codec, b"\xc3\x02" + good[2:]) == "bad_marker"
    assert _reason(codec, b'{"json": true}') == "bad_marker"
    assert _reason(codec, good + b"\x00") == "trailing_bytes"


def test_registry_framing_without_a_registry_is_refused_naming_the_flag(
    codec: TrajectoryCodec, good: bytes
) -> None:
    for framed in (b"\x00", b"\x00\x00\x00\x01", b"\x00\x00\x00\x00\x07" + good[10:]):
        with pytest.raises(RecordDecodeError) as e:
            codec.decode(framed)
        assert e.value.reason == ("truncated" if len(framed) < 5 else "unknown_schema")
    assert "schema id 7" in str(e.value) and "--schema-registry" in str(e.value)


def test_unknown_fingerprint(codec: TrajectoryCodec, good: bytes) -> None:
    assert _reason(codec, good[:2] + b"\x01" * 8 + good[10:]) == "unknown_schema"
    other = AvroCodec("WeightsAnnouncement").fingerprint
    assert _reason(codec, good[:2] + other + good[10:]) == "unknown_schema"


def test_absurd_length_prefix_allocates_nothing(codec: TrajectoryCodec) -> None:
    import tracemalloc

    # header, then a trajectory_id string claiming 2**60 bytes
    data = MARKER + codec.fingerprint + b"\x80\x80\x80\x80\x80\x80\x80\x80\x20" + b"x" * 10
    tracemalloc.start()
    assert _reason(codec, data) == "bad_length"
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1_000_000
    # negative length
    assert _reason(codec, MARKER + codec.fingerprint + b"\x03abc") == "bad_length"


def test_huge_array_count_is_refused(codec: TrajectoryCodec) -> None:
    import tracemalloc

    from pipeline.records.avro_binary import write_long

    d = to_avro_dict(make_trajectory(16, turns=2))
    pos = _position(d, "version_spans", [], [{"start": 0, "end": 1, "version": 0}])
    body = _raw(dict(d, version_spans=[]))
    huge = bytearray()
    write_long(huge, 2**40)
    tracemalloc.start()
    assert _reason(codec, body[:pos] + bytes(huge) + body[pos + 1 :]) == "bad_length"
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1_000_000


def test_tensor_shape_disagreeing_with_data(codec: TrajectoryCodec) -> None:
    d = to_avro_dict(make_trajectory(16))
    d["tokens"]["shape"] = [17]
    assert _reason(codec, _raw(d)) == "tensor_mismatch"
    d["tokens"]["shape"] = [-16]
    assert _reason(codec, _raw(d)) == "tensor_mismatch"


def test_lengths_that_disagree(codec: TrajectoryCodec) -> None:
    d = to_avro_dict(make_trajectory(16))
    d["loss_mask"] = {"dtype": "uint8", "shape": [15], "data": b"\x00" * 15}
    assert _reason(codec, _raw(d)) == "length_mismatch"


def test_non_finite_reward_and_logprob(codec: TrajectoryCodec) -> None:
    d = to_avro_dict(make_trajectory(16))
    d["reward"] = math.nan
    assert _reason(codec, _raw(d)) == "non_finite"
    d = to_avro_dict(make_trajectory(16))
    d["logprobs"]["data"] = np.full(16, np.inf, np.float32).tobytes()
    assert _reason(codec, _raw(d)) == "non_finite"


def test_unknown_enum_index(codec: TrajectoryCodec) -> None:
    d = to_avro_dict(make_trajectory(16, turns=2))
    pos = _position(d, "status", "ok", "timeout")
    body = bytearray(_raw(d))
    assert body[pos] == 0  # "ok" is symbol 0
    body[pos] = 2 * 9  # zig-zag of 9: there are 4 symbols
    assert _reason(codec, bytes(body)) == "bad_enum"


def _position(d: dict[str, object], field: str, a: object, b: object) -> int:
    """Byte offset where the encodings with ``field`` = a and = b first differ."""
    x, y = _raw(dict(d, **{field: a})), _raw(dict(d, **{field: b}))
    return next(i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"turn_roles": {"dtype": "int32", "shape": [4], "data": b"\0" * 16}}, "invalid"),
        ({"turn_roles": {"dtype": "uint8", "shape": [3], "data": b"\0\1\2"}}, "length_mismatch"),
        ({"turn_roles": {"dtype": "uint8", "shape": [4], "data": b"\0\1\7\1"}}, "bad_enum"),
        ({"turn_tool_names": ["a", "b"]}, "length_mismatch"),
        (
            {"turn_starts": {"dtype": "int32", "shape": [2, 2], "data": b"\0" * 16}},
            "length_mismatch",
        ),
        ({"turn_ends": {"dtype": "int32", "shape": [4], "data": b"\xff" * 16}}, "bad_span"),
        ({"turn_latency_s": {"dtype": "float32", "shape": [4], "data": b"\0" * 16}}, "invalid"),
    ],
)
def test_turn_columns_are_checked(change: dict, reason: str) -> None:
    t = make_trajectory(40, rng=np.random.default_rng(5), turns=4)
    d = to_avro_dict(t)
    d.update(change)
    with pytest.raises(RecordDecodeError) as e:
        TrajectoryCodec().decode(TrajectoryCodec().encode_avro_dict(d))
    assert e.value.reason == reason


def test_turns_out_of_order_are_refused_in_numpy_too() -> None:
    """Above 32 turns the check is vectorised: the same refusals."""
    for turns in (8, 40):
        t = make_trajectory(400, rng=np.random.default_rng(turns), turns=turns)
        assert TrajectoryCodec().decode(TrajectoryCodec().encode(t)).turns == t.turns
        d = to_avro_dict(t)
        starts = np.frombuffer(d["turn_starts"]["data"], "<i4").copy()
        k = turns // 2  # two turns' starts swapped: out of order
        starts[k], starts[k + 1] = starts[k + 1], starts[k]
        d["turn_starts"]["data"] = starts.tobytes()
        with pytest.raises(RecordDecodeError) as e:
            TrajectoryCodec().decode(TrajectoryCodec().encode_avro_dict(d))
        assert e.value.reason == "bad_span", turns


@pytest.mark.parametrize("dtype", ["uint8", "int32", "float32", "float64", "int64", "bfloat16"])
@pytest.mark.parametrize("n", [0, 1, 31, 32, 63, 64, 2047, 2048, 8191, 8192, 70_000])
def test_tensor_shortcuts_write_and_read_what_the_generated_code_does(dtype: str, n: int) -> None:
    """The hand-written 1-D path and the code generated from the schema agree byte for
    byte, and each reads the other's bytes."""
    from pipeline.records.avro_binary import CompiledSchema
    from pipeline.records.tensor import DTYPES, tensor_fields, tensor_from_avro
    from pipeline.records.tensor import read_tensor_1d as _read_tensor_1d
    from pipeline.records.tensor import write_tensor_1d as _write_tensor_1d

    canonical = default_store().reader("Tensor").canonical_form
    generic = CompiledSchema(
        canonical,
        {"rlstream.Tensor": tensor_fields},
        {"rlstream.Tensor": tensor_from_avro},
        native=False,
    )
    plain_codec = CompiledSchema(canonical, native=False)  # the same schema, as plain dicts
    array = np.arange(n).astype(DTYPES[dtype])

    out = bytearray()
    assert _write_tensor_1d(out, array)
    assert bytes(out) == generic.encode(array)
    back, end = _read_tensor_1d(bytes(out), 0)  # type: ignore[misc]
    assert end == len(out) and back.dtype == array.dtype and back.tobytes() == array.tobytes()
    plain, _ = plain_codec.decode(bytes(out))
    assert plain["shape"] == [n] and plain["data"] == array.tobytes()
    # other shapes and non-contiguous arrays are declined, and then written generically
    assert not _write_tensor_1d(bytearray(), array.reshape(1, n))
    assert not _write_tensor_1d(bytearray(), array[::2]) or n < 2
    two_d = generic.encode(array.reshape(1, n))
    assert _read_tensor_1d(two_d, 0) is None
    assert generic.decode(two_d)[0].shape == (1, n)


def test_a_registry_that_answers_garbage_for_an_id_gives_it_up_after_bounded_tries() -> None:
    """An error status, a body that is not JSON or one of 5 MB for one schema id: the
    record is held (the registry may recover) for ``BAD_ANSWERS`` answers, then refused
    as ``unknown_schema`` and the id is not asked for again. A registry that does not
    answer at all is held for as long as it takes, and one that refuses the credentials
    too (the same for every id)."""
    import http.server
    import threading

    from pipeline.errors import RegistryUnavailableError
    from pipeline.records.registry import BAD_ANSWERS, RegistryConfig, SchemaRegistry
    from pipeline.records.schema_store import SchemaStore

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            schema_id = int(self.path.rsplit("/", 1)[1])
            status, body = {
                7: (500, b"<html>proxy error</html>"),
                8: (200, b"not json {"),
                9: (200, b'{"schema": "' + b"x" * (5 << 20) + b'"}'),
                10: (401, b'{"message": "who are you"}'),
            }[schema_id]
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store = SchemaStore()
        registry = SchemaRegistry(RegistryConfig(f"http://127.0.0.1:{server.server_port}"))
        store.registry = registry
        for schema_id, why in ((7, "HTTP 500"), (8, "not JSON"), (9, "not JSON")):
            for _ in range(BAD_ANSWERS - 1):
                with pytest.raises(RegistryUnavailableError):
                    store.writer_by_id(schema_id)
            with pytest.raises(RecordDecodeError, match=why) as refused:
                store.writer_by_id(schema_id)
            assert refused.value.reason == "unknown_schema"
            asked = registry.requests
            with pytest.raises(RecordDecodeError, match="answers in a row"):
                store.writer_by_id(schema_id)
            assert registry.requests == asked  # given up: not asked again
        for _ in range(BAD_ANSWERS + 2):
            with pytest.raises(RegistryUnavailableError, match="refused the credentials"):
                store.writer_by_id(10)
    finally:
        server.shutdown()


def test_a_registry_that_is_down_never_stops_a_writer_of_internal_records() -> None:
    """Announcements, heartbeats, telemetry and dead letters are framed for the registry
    when it takes their schema; while it does not answer they go out single-object
    encoded (every reader takes both), and registering is tried again later, not at
    every record."""
    import time

    from pipeline.records.codec import AvroCodec
    from pipeline.records.registry import RegistryConfig, SchemaRegistry
    from pipeline.records.schema_store import SchemaStore

    store = SchemaStore()
    store.registry = SchemaRegistry(RegistryConfig("http://127.0.0.1:9"))  # nothing there
    codec = AvroCodec("Telemetry", store)
    assert codec.framing_for("ns.telemetry") is None
    asked = store.registry.requests
    start = time.monotonic()
    for _ in range(100):
        assert codec.framing_for("ns.telemetry") is None
    assert store.registry.requests == asked and time.monotonic() - start < 0.5
