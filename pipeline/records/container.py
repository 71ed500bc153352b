"""Avro container files (what a recording is), read block by block within bounds.

fastavro's own reader inflates each deflate block whole: a 4 MB block of zeros written
to inflate to 2.5 GB takes that much memory before a record is read. This reader
follows the container format of the Avro specification (magic, metadata, sync marker,
then blocks of ``count``, ``size``, data, sync) and inflates each block with a bound
(``MAX_BLOCK_BYTES``, far above what rlstream's writer makes: blocks of about 16 KB plus
one record of at most 16 MiB); the records are then read with fastavro's schemaless
reader. Whatever is wrong raises :class:`ContainerError` with the reason.
"""

from __future__ import annotations

import io
import json
import zlib
from collections.abc import Iterator
from typing import IO, Any

import fastavro
from fastavro.read import HEADER_SCHEMA

from pipeline.errors import RlstreamError

MAGIC = b"Obj\x01"
#: the most bytes one block may inflate to
MAX_BLOCK_BYTES = 64 << 20


class ContainerError(RlstreamError):
    """One of the file's blocks is damaged, cut or too large."""


class NotAContainerError(ContainerError):
    """The file does not begin as an Avro container file."""


def _long(f: IO[bytes]) -> int | None:
    """An Avro long (zig-zag varint) from ``f``; None at the end of the file."""
    shift = result = 0
    for i in range(10):
        b = f.read(1)
        if not b:
            if i == 0:
                return None
            raise ContainerError("the file ends inside a block header")
        result |= (b[0] & 0x7F) << shift
        if not b[0] & 0x80:
            return (result >> 1) ^ -(result & 1)
        shift += 7
    raise ContainerError("a block header holds a number longer than 10 bytes")


def read_blocks(f: IO[bytes], reader_schema: Any) -> Iterator[list[Any]]:
    """The records of each block of the container file ``f``, read into
    ``reader_schema``, one list per block."""
    if f.read(4) != MAGIC:
        raise NotAContainerError("it does not begin with an Avro container file's magic")
    f.seek(0)
    try:
        header: dict[str, Any] = fastavro.schemaless_reader(f, HEADER_SCHEMA)  # type: ignore[assignment]
        meta, sync = header["meta"], header["sync"]
        writer = fastavro.parse_schema(json.loads(meta["avro.schema"]))
    except Exception as e:  # a header that does not read
        raise NotAContainerError(f"its header does not read: {type(e).__name__}: {e}") from None
    codec = meta.get("avro.codec", b"null")
    if codec not in (b"null", b"deflate"):
        raise NotAContainerError(f"its codec {codec[:40]!r} is not null or deflate")
    reader = fastavro.parse_schema(reader_schema)
    while True:
        count = _long(f)
        if count is None:
            return
        size = _long(f)
        if size is None or not 0 <= size <= MAX_BLOCK_BYTES or count < 0:
            raise ContainerError(f"a block declares {count} records in {size} bytes")
        data = f.read(size)
        if len(data) < size:
            raise ContainerError(f"a block of {size} bytes is cut at {len(data)}")
        if codec == b"deflate":
            inflate = zlib.decompressobj(-15)
            try:
                data = inflate.decompress(data, MAX_BLOCK_BYTES)
            except zlib.error as e:
                raise ContainerError(f"a block does not inflate: {e}") from None
            if inflate.unconsumed_tail:
                raise ContainerError(
                    f"a block inflates to more than {MAX_BLOCK_BYTES >> 20} MiB "
                    "(rlstream writes blocks of a few)"
                )
        if count > len(data):  # every record takes at least a byte here
            raise ContainerError(f"a block declares {count} records in {len(data)} bytes")
        if f.read(16) != sync:
            raise ContainerError("a block does not end with the file's sync marker")
        buf = io.BytesIO(data)
        try:
            rows = [fastavro.schemaless_reader(buf, writer, reader) for _ in range(count)]
        except Exception as e:  # records that do not read
            raise ContainerError(f"a record does not read: {type(e).__name__}: {e}") from None
        yield rows
