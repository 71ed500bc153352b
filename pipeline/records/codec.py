"""Avro single-object encoding of rlstream records, and Kafka headers for trajectories.

Wire format (Avro specification, "single-object encoding")::

    C3 01 | 8-byte CRC-64-AVRO fingerprint of the writer schema (little-endian) | body

or, written with a schema registry (``--schema-registry``), Confluent's::

    00 | 4-byte big-endian schema id | body

Readers take both. The reader looks the writer schema up by fingerprint in its
:class:`SchemaStore` (by id: through the store's registry, cached) and reads the body
into its own reader schema, following Avro's resolution rules. Arrays travel as
``Tensor`` records (dtype, shape, raw little-endian bytes) and become numpy arrays with
``np.frombuffer``: no per-element Python work.

Every failure to read raises :class:`~pipeline.errors.RecordDecodeError` with a stable
``reason``. Reading never allocates more than the input's size: length prefixes are
checked against the bytes that are actually there.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from fastavro import schemaless_reader

from pipeline.errors import InvalidTrajectoryError, RecordDecodeError
from pipeline.records import registry
from pipeline.records.avro_binary import CompiledSchema, read_long, write_long
from pipeline.records.schema_store import Schema, SchemaStore, default_store
from pipeline.records.trajectory import (
    Timings,
    Trajectory,
    Turn,
    Turns,
    VersionSpan,
    find_violation,
)

MARKER = b"\xc3\x01"
HEADER_SIZE = len(MARKER) + 8
MAX_TENSOR_DIMS = 8
MAX_TENSOR_EXTENT = 2**31


def _dtypes() -> dict[str, np.dtype[Any]]:
    import ml_dtypes  # shipped with jax

    names = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64")
    out = {n: np.dtype(n).newbyteorder("<") for n in names}
    out.update(
        uint64=np.dtype("<u8"),
        float16=np.dtype("<f2"),
        float32=np.dtype("<f4"),
        float64=np.dtype("<f8"),
        bfloat16=np.dtype(ml_dtypes.bfloat16),
    )
    return out


DTYPES = _dtypes()
_DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}


def tensor_from_avro(dtype_name: str, shape: list[int], data: bytes) -> np.ndarray:
    """The fields of a ``Tensor`` record as a read-only numpy array over ``data``.

    The shape must describe exactly the bytes given, in at most :data:`MAX_TENSOR_DIMS`
    non-negative dimensions whose non-zero ones multiply to at most ``2**31`` (so an
    empty ``[2**62, 0]`` tensor is refused here instead of overflowing numpy)."""
    dtype = DTYPES[dtype_name]
    if len(shape) == 1 and 0 <= shape[0] * dtype.itemsize == len(data):  # the usual case
        return np.frombuffer(data, dtype=dtype)
    count, extent = 1, 1
    for d in shape[: MAX_TENSOR_DIMS + 1]:
        if d < 0:
            count = extent = -1
            break
        count *= d
        extent *= max(d, 1)
    if (
        len(shape) > MAX_TENSOR_DIMS
        or not 0 <= extent <= MAX_TENSOR_EXTENT
        or count * dtype.itemsize != len(data)
    ):
        raise RecordDecodeError(
            "tensor_mismatch",
            f"{dtype_name}{list(shape[: MAX_TENSOR_DIMS + 1])} disagrees with its "
            f"{len(data)} bytes of data",
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)


class AvroCodec:
    """Single-object encoding of one record type (e.g. ``"WeightsAnnouncement"``).

    ``encode`` takes the record as a dict (or as the Python objects the ``adapters`` know);
    ``decode`` returns one read into this process's reader schema, whichever known schema
    version wrote it. Records written with the reader's own schema take a compiled fast
    path; other versions are resolved by fastavro following Avro's rules.
    """

    def __init__(
        self,
        record: str,
        store: SchemaStore | None = None,
        *,
        adapters: Mapping[str, Callable[[Any], tuple[Any, ...]]] | None = None,
        factories: Mapping[str, Callable[..., Any]] | None = None,
        shortcuts: Mapping[str, tuple[Callable[..., Any], Callable[..., Any]]] | None = None,
    ) -> None:
        self._store = store or default_store()
        self.schema: Schema = self._store.reader(record)
        self._compiled = CompiledSchema(self.schema.canonical_form, adapters, factories, shortcuts)
        # plain (dict) codecs of other writer versions and of the reader, compiled once:
        # only records written with another schema version need them
        self._plain: dict[bytes, CompiledSchema] = {}
        self._prefix = MARKER + self.schema.fingerprint

    @property
    def fingerprint(self) -> bytes:
        return self.schema.fingerprint

    def encode(self, datum: Any, framing: bytes | None = None) -> bytes:
        """The record in single-object encoding, or after ``framing`` (the Confluent
        header of a schema id, :func:`pipeline.records.registry.framing`)."""
        return self._compiled.encode(datum, self._prefix if framing is None else framing)

    def decode(self, data: bytes | bytearray | memoryview) -> Any:
        data = bytes(data)
        if data[:1] == registry.MAGIC:
            if len(data) < registry.HEADER_SIZE:
                raise RecordDecodeError("truncated", f"{len(data)} bytes, shorter than the header")
            writer = self._store.writer_by_id(registry.schema_id_of(data))
            start = registry.HEADER_SIZE
            if writer.fingerprint == self.schema.fingerprint:
                return self._read(data, start)
        else:
            if not data or data[:2] != MARKER[: len(data[:2])]:
                raise RecordDecodeError(
                    "bad_marker", "neither Avro single-object encoding (C3 01) nor a registry's 00"
                )
            if len(data) < HEADER_SIZE:
                raise RecordDecodeError("truncated", f"{len(data)} bytes, shorter than the header")
            if data[:HEADER_SIZE] == self._prefix:
                return self._read(data, HEADER_SIZE)
            fingerprint = data[2:HEADER_SIZE]
            found = self._store.writer(fingerprint)
            if found is None:
                raise RecordDecodeError(
                    "unknown_schema", f"writer schema fingerprint {fingerprint.hex()} is unknown"
                )
            writer, start = found, HEADER_SIZE
        record, _ = self._compiled.decode(self._resolve(writer, data, start), 0)
        return record

    def _read(self, data: bytes, start: int) -> Any:
        record, end = self._compiled.decode(data, start)
        if end != len(data):
            raise RecordDecodeError("trailing_bytes", f"{len(data) - end} bytes after the record")
        return record

    def _resolve(self, writer: Schema, data: bytes, start: int) -> bytes:
        """Read a body written with another schema version into the reader's schema
        (Avro resolution, by fastavro) and return it in the reader's encoding."""
        if writer.name != self.schema.name:
            raise RecordDecodeError(
                "unknown_schema", f"record is a {writer.name}, expected {self.schema.name}"
            )
        # Check the body with the writer's own compiled reader first: it bounds every
        # length prefix, which fastavro does not do for arrays and maps.
        _, end = self._plain_codec(writer).decode(data, start)
        if end != len(data):
            raise RecordDecodeError("trailing_bytes", f"{len(data) - end} bytes after the record")
        body = io.BytesIO(data)
        body.seek(start)
        try:
            value = schemaless_reader(body, writer.parsed, self.schema.parsed)
        except Exception as e:  # resolution failures: a symbol or field the reader lacks
            raise RecordDecodeError(
                "bad_enum" if "symbol" in str(e).lower() else "invalid",
                f"cannot read {writer.name} into this version: {str(e)[:200]}",
            ) from None
        try:
            return self._plain_codec(self.schema).encode(value)
        except Exception as e:  # a resolved value this version cannot hold
            raise RecordDecodeError("invalid", f"{type(e).__name__}: {str(e)[:200]}") from None

    def _plain_codec(self, schema: Schema) -> CompiledSchema:
        codec = self._plain.get(schema.fingerprint)
        if codec is None:
            codec = self._plain[schema.fingerprint] = CompiledSchema(schema.canonical_form)
        return codec


#: the element types in the order of the Tensor schema's Dtype symbols
_DTYPE_LIST = tuple(
    DTYPES[name] for name in default_store().reader("Tensor").parsed["fields"][0]["type"]["symbols"]
)
_DTYPE_INDEX = {dt: i for i, dt in enumerate(_DTYPE_LIST)}
#: element types numpy cannot export through the buffer protocol (ml_dtypes' bfloat16)
_NO_BUFFER = frozenset({DTYPES["bfloat16"]})


def _raw(d: np.ndarray) -> Any:
    """A C-ordered array's bytes, without a copy where numpy allows."""
    return d.tobytes() if d.dtype in _NO_BUFFER else d.data.cast("B")


def _write_tensor_1d(out: bytearray, d: Any) -> bool:
    """A 1-D C-ordered array in the Tensor encoding without building its fields (False:
    not such an array, the generic writer takes it)."""
    if type(d) is not np.ndarray or d.ndim != 1 or not d.flags.c_contiguous:
        return False
    i = _DTYPE_INDEX.get(d.dtype)
    if i is None:
        return False
    n, size = d.shape[0], d.nbytes
    out.append(i << 1)
    out.append(2)  # one block of one dimension
    if n < 64:
        out.append(n << 1)
    else:
        write_long(out, n)
    out.append(0)
    if size < 64:
        out.append(size << 1)
    else:
        write_long(out, size)
    out += _raw(d)
    return True


def _read_tensor_1d(buf: bytes, pos: int) -> tuple[np.ndarray, int] | None:
    """A 1-D Tensor as a read-only array over ``buf`` itself (no copy), or None for any
    other shape or encoding, which the generic reader then checks and reads."""
    code = buf[pos]
    if code & 1 or code >= 2 * len(_DTYPE_LIST) or buf[pos + 1] != 2:
        return None
    b = buf[pos + 2]
    if b < 128:  # a one-byte varint (zig-zag: odd is negative)
        if b & 1:
            return None
        dim, p = b >> 1, pos + 3
    else:
        dim, p = read_long(buf, pos + 2)
    if dim < 0 or buf[p] != 0:
        return None
    b = buf[p + 1]
    if b < 128:
        if b & 1:
            return None
        size, p = b >> 1, p + 2
    else:
        size, p = read_long(buf, p + 1)
    dtype = _DTYPE_LIST[code >> 1]
    if size != dim * dtype.itemsize or size > len(buf) - p:
        return None
    return np.frombuffer(buf, dtype, dim, p), p + size


def _tensor_fields(d: Any) -> tuple[Any, ...]:
    if type(d) is np.ndarray and d.ndim == 1 and d.flags.c_contiguous:  # the usual case
        name = _DTYPE_NAMES.get(d.dtype)
        if name is not None:
            return name, d.shape, _raw(d)
    if isinstance(d, np.ndarray):
        name = _DTYPE_NAMES.get(d.dtype.newbyteorder("<") if d.dtype.byteorder == ">" else d.dtype)
        if name is None:
            raise InvalidTrajectoryError(f"dtype {d.dtype} cannot be stored in a Tensor")
        return name, d.shape, np.ascontiguousarray(d, dtype=DTYPES[name]).tobytes()
    return d["dtype"], d["shape"], d["data"]


def _trajectory_fields(t: Trajectory) -> tuple[Any, ...]:
    """The values of a version-2 record: the turns as columns, the old array empty."""
    turns = t.turns if type(t.turns) is Turns else Turns.of(t.turns)
    return (
        t.trajectory_id,
        t.group_id,
        t.group_size,
        t.group_index,
        t.task_id,
        t.producer_id,
        t.env,
        t.tokenizer_id,
        t.tokens,
        t.loss_mask,
        t.logprobs,
        t.version_spans,
        (),
        turns.roles,
        turns.starts,
        turns.ends,
        turns.latency_s,
        turns.tool_names,
        t.reward,
        t.rewards,
        t.status,
        t.timings,
        t.metadata,
    )


def _trajectory(
    trajectory_id: str,
    group_id: str,
    group_size: int,
    group_index: int,
    task_id: str,
    producer_id: str,
    env: str,
    tokenizer_id: str,
    tokens: np.ndarray,
    loss_mask: np.ndarray,
    logprobs: np.ndarray,
    version_spans: list[VersionSpan],
    turns: list[Turn],
    roles: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    latency_s: np.ndarray,
    tool_names: list[str],
    *rest: Any,
) -> Trajectory:
    """A trajectory from a version-2 record's values (turns from whichever form holds
    them: a version-1 record read into version 2 has its turns in the old array)."""
    if turns:
        if roles.shape != (0,) or tool_names:
            raise RecordDecodeError("invalid", "turns given both as records and as columns")
        columns = Turns.of(turns)
    else:
        columns = Turns(roles, starts, ends, latency_s, tool_names)
    return Trajectory(
        trajectory_id,
        group_id,
        group_size,
        group_index,
        task_id,
        producer_id,
        env,
        tokenizer_id,
        tokens,
        loss_mask,
        logprobs,
        version_spans,
        columns,
        *rest,
    )


class TrajectoryCodec:
    """Encodes :class:`Trajectory` objects as Avro single-object records and back.

    ``encode`` refuses a trajectory that breaks the record contract
    (:class:`InvalidTrajectoryError`); ``decode`` refuses bytes that are not a valid
    trajectory (:class:`RecordDecodeError`).
    """

    def __init__(self, store: SchemaStore | None = None) -> None:
        self._avro = AvroCodec(
            "Trajectory",
            store,
            adapters={"rlstream.Tensor": _tensor_fields, "rlstream.Trajectory": _trajectory_fields},
            shortcuts={"rlstream.Tensor": (_write_tensor_1d, _read_tensor_1d)},
            factories={
                "rlstream.Tensor": tensor_from_avro,
                "rlstream.VersionSpan": VersionSpan,
                "rlstream.Turn": Turn,
                "rlstream.Timings": Timings,
                "rlstream.Trajectory": _trajectory,
            },
        )

    @property
    def fingerprint(self) -> bytes:
        return self._avro.fingerprint

    @property
    def schema(self) -> Schema:
        return self._avro.schema

    def encode(self, t: Trajectory, framing: bytes | None = None) -> bytes:
        """The record, single-object encoded or after ``framing`` (a registry's header)."""
        violation = find_violation(t)
        if violation is not None:
            raise InvalidTrajectoryError(f"{violation[0]}: {violation[1]}")
        try:
            return self._avro.encode(t, framing)
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidTrajectoryError(f"invalid: {e}") from None

    def decode(self, data: bytes | bytearray | memoryview) -> Trajectory:
        t: Trajectory = self._avro.decode(data)
        violation = find_violation(t)
        if violation is not None:
            raise RecordDecodeError(*violation)
        return t

    def from_avro_dict(self, d: Mapping[str, Any]) -> Trajectory:
        """The inverse of :func:`to_avro_dict`: a trajectory from the plain Avro value
        other Avro libraries (e.g. a container file reader) produce; checked like a
        decoded record."""
        return self.decode(self.encode_avro_dict(d))

    def encode_avro_dict(self, d: Mapping[str, Any]) -> bytes:
        """Single-object bytes of a trajectory given as its plain Avro value (not checked:
        :meth:`decode` checks them)."""
        return MARKER + self.fingerprint + self._avro._plain_codec(self._avro.schema).encode(d)

    def headers(self, t: Trajectory) -> list[tuple[str, bytes]]:
        """Kafka headers that let a consumer filter without decoding the value."""
        return trajectory_headers(t, self.fingerprint)


# ---- Kafka headers ----------------------------------------------------------------

H_SCHEMA = "rlstream.schema"
H_ENV = "rlstream.env"
H_GROUP = "rlstream.group"
H_VERSION_MIN = "rlstream.version.min"
H_VERSION_MAX = "rlstream.version.max"
H_TOKENS = "rlstream.tokens"


class TrajectoryHeaders(NamedTuple):
    """What a consumer can know of a trajectory record without decoding its value.

    Fields a record lacks (or carries malformed) are None.
    """

    schema: bytes | None
    env: str | None
    group_id: str | None
    min_version: int | None
    max_version: int | None
    num_tokens: int | None

    @classmethod
    def parse(cls, headers: Sequence[tuple[str, bytes | None]] | None) -> TrajectoryHeaders:
        h = {k: v for k, v in (headers or ()) if v is not None}
        return cls(
            schema=_hex(h.get(H_SCHEMA)),
            env=_text(h.get(H_ENV)),
            group_id=_text(h.get(H_GROUP)),
            min_version=_int(h.get(H_VERSION_MIN)),
            max_version=_int(h.get(H_VERSION_MAX)),
            num_tokens=_int(h.get(H_TOKENS)),
        )


def trajectory_headers(t: Trajectory, fingerprint: bytes) -> list[tuple[str, bytes]]:
    return [
        (H_SCHEMA, fingerprint.hex().encode()),
        (H_ENV, t.env.encode()),
        (H_GROUP, t.group_id.encode()),
        (H_VERSION_MIN, str(t.min_version).encode()),
        (H_VERSION_MAX, str(t.max_version).encode()),
        (H_TOKENS, str(t.num_tokens).encode()),
    ]


def _text(v: bytes | None) -> str | None:
    if v is None:
        return None
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _int(v: bytes | None) -> int | None:
    if v is None or len(v) > 20:
        return None
    try:
        return int(v)
    except ValueError:
        return None


def _hex(v: bytes | None) -> bytes | None:
    if v is None or len(v) != 16:
        return None
    try:
        return bytes.fromhex(v.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None


def to_avro_dict(t: Trajectory) -> dict[str, Any]:
    """The Avro value of a trajectory as plain dicts and lists (Tensors as
    ``{dtype, shape, data}``), as other Avro libraries take it."""
    turns = Turns.of(t.turns)
    return {
        "trajectory_id": t.trajectory_id,
        "group_id": t.group_id,
        "group_size": t.group_size,
        "group_index": t.group_index,
        "task_id": t.task_id,
        "producer_id": t.producer_id,
        "env": t.env,
        "tokenizer_id": t.tokenizer_id,
        "tokens": _tensor_dict(t.tokens),
        "loss_mask": _tensor_dict(t.loss_mask),
        "logprobs": _tensor_dict(t.logprobs),
        "version_spans": [s._asdict() for s in t.version_spans],
        "turns": [],
        "turn_roles": _tensor_dict(turns.roles),
        "turn_starts": _tensor_dict(turns.starts),
        "turn_ends": _tensor_dict(turns.ends),
        "turn_latency_s": _tensor_dict(turns.latency_s),
        "turn_tool_names": list(turns.tool_names),
        "reward": t.reward,
        "rewards": dict(t.rewards),
        "status": t.status,
        "timings": t.timings._asdict(),
        "metadata": dict(t.metadata),
    }


def _tensor_dict(array: np.ndarray) -> dict[str, Any]:
    dtype, shape, data = _tensor_fields(array)
    return {"dtype": dtype, "shape": list(shape), "data": bytes(data)}
