"""Avro single-object encoding of rlstream records, and the trajectory codec.

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

import functools
import io
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from fastavro import schemaless_reader

from pipeline.errors import InvalidTrajectoryError, RecordDecodeError
from pipeline.records import registry, tensor
from pipeline.records.avro_binary import CompiledSchema, Shortcut
from pipeline.records.headers import TrajectoryHeaders, trajectory_headers
from pipeline.records.schema_store import Schema, SchemaStore, default_store
from pipeline.records.trajectory import (
    Timings,
    Trajectory,
    Turn,
    Turns,
    VersionSpan,
    find_violation,
)

__all__ = [
    "HEADER_SIZE",
    "MARKER",
    "AvroCodec",
    "TrajectoryCodec",
    "TrajectoryHeaders",
    "to_avro_dict",
]

log = logging.getLogger(__name__)

MARKER = b"\xc3\x01"
HEADER_SIZE = len(MARKER) + 8


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
        shortcuts: Mapping[str, Shortcut] | None = None,
        native: bool | None = None,
    ) -> None:
        self._store = store or default_store()
        self.schema: Schema = self._store.reader(record)
        self._compiled = CompiledSchema(
            self.schema.canonical_form, adapters, factories, shortcuts, native=native
        )
        self._native = native
        # plain (dict) codecs of other writer versions and of the reader, compiled once:
        # only records written with another schema version need them
        self._plain: dict[bytes, CompiledSchema] = {}
        self._prefix = MARKER + self.schema.fingerprint
        #: topic -> (its framing, or None until the time to try registering again)
        self._framings: dict[str, tuple[bytes | None, float]] = {}

    @property
    def fingerprint(self) -> bytes:
        return self.schema.fingerprint

    @property
    def native(self) -> bool:
        """Whether the C codec writes and reads these records."""
        return self._compiled.native

    def framing_for(self, topic: str) -> bytes | None:
        """The framing of this record type's values on ``topic``: with a schema registry
        (``--schema-registry``), the schema is registered under ``<topic>-value`` and
        values carry its id (Confluent's wire format); without one, None (single-object
        encoding). A registry that does not answer, or refuses the schema, never stops
        the writer: its values go out single-object encoded (every rlstream reader takes
        both framings), the failure is logged, and registering is tried again after
        ``DOWN_S`` seconds."""
        registry_ = self._store.registry
        if registry_ is None:
            return None
        now = time.monotonic()
        cached = self._framings.get(topic)
        if cached is not None and (cached[0] is not None or now < cached[1]):
            return cached[0]
        try:
            framing = registry.framing(registry_.register(f"{topic}-value", self.schema.text))
        except registry.RegistryError as e:
            log.warning(
                "records to %s written single-object encoded until the schema registry "
                "takes their schema (tried again in %.0f s): %s",
                topic,
                registry.DOWN_S,
                str(e)[:300],
            )
            self._framings[topic] = (None, now + registry.DOWN_S)
            return None
        self._framings[topic] = (framing, 0.0)
        return framing

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
            codec = self._plain[schema.fingerprint] = CompiledSchema(
                schema.canonical_form, native=self._native
            )
        return codec


@functools.cache
def shared_codec(name: str) -> AvroCodec:
    """One codec of record ``name`` for this process's writers (it remembers the schema
    registry's answers)."""
    return AvroCodec(name)


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

    def __init__(self, store: SchemaStore | None = None, *, native: bool | None = None) -> None:
        """``native``: the C codec (True), its Python reference (False) or the C codec
        where it is built (None, see :func:`pipeline.records.avro_program.native_available`)."""
        self._avro = AvroCodec(
            "Trajectory",
            store,
            adapters={
                "rlstream.Tensor": tensor.tensor_fields,
                "rlstream.Trajectory": _trajectory_fields,
            },
            shortcuts={"rlstream.Tensor": tensor.SHORTCUT},
            factories={
                "rlstream.Tensor": tensor.tensor_from_avro,
                "rlstream.VersionSpan": VersionSpan,
                "rlstream.Turn": Turn,
                "rlstream.Timings": Timings,
                "rlstream.Trajectory": _trajectory,
            },
            native=native,
        )
        self._native_check = native is not False

    @property
    def fingerprint(self) -> bytes:
        return self._avro.fingerprint

    @property
    def native(self) -> bool:
        """Whether the C codec writes and reads trajectories."""
        return self._avro.native

    @property
    def schema(self) -> Schema:
        return self._avro.schema

    def encode(self, t: Trajectory, framing: bytes | None = None) -> bytes:
        """The record, single-object encoded or after ``framing`` (a registry's header).

        Raises :class:`InvalidTrajectoryError` for a trajectory that breaks the contract
        or holds a value of the wrong Python type."""
        try:
            violation = find_violation(t, native=self._native_check)
            if violation is None:
                return self._avro.encode(t, framing)
        except (TypeError, ValueError, OverflowError, AttributeError, KeyError) as e:
            raise InvalidTrajectoryError(f"invalid: {type(e).__name__}: {e}") from None
        raise InvalidTrajectoryError(f"{violation[0]}: {violation[1]}")

    def decode(self, data: bytes | bytearray | memoryview) -> Trajectory:
        t: Trajectory = self._avro.decode(data)
        violation = find_violation(t, native=self._native_check)
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
        "tokens": tensor.tensor_dict(t.tokens),
        "loss_mask": tensor.tensor_dict(t.loss_mask),
        "logprobs": tensor.tensor_dict(t.logprobs),
        "version_spans": [s._asdict() for s in t.version_spans],
        "turns": [],
        "turn_roles": tensor.tensor_dict(turns.roles),
        "turn_starts": tensor.tensor_dict(turns.starts),
        "turn_ends": tensor.tensor_dict(turns.ends),
        "turn_latency_s": tensor.tensor_dict(turns.latency_s),
        "turn_tool_names": list(turns.tool_names),
        "reward": t.reward,
        "rewards": dict(t.rewards),
        "status": t.status,
        "timings": t.timings._asdict(),
        "metadata": dict(t.metadata),
    }
