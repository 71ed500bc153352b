"""TensorBoard scalars without TensorFlow: ``events.out.tfevents.*`` files written directly.

An event file is a sequence of TFRecords (length, masked CRC-32C of the length, the bytes,
masked CRC-32C of the bytes), each holding one serialized ``tensorflow.Event`` protobuf.
The first event names the file version; each later one carries a step, a wall time and a
``Summary`` of ``simple_value`` scalars. That subset of protobuf (varints, fixed64,
fixed32, length-delimited fields) is written by hand here, so scalars cost no dependency;
the test suite reads the files back with TensorBoard's own reader.

Point TensorBoard at a run directory's ``tensorboard/`` folder:
``tensorboard --logdir runs/<run>/tensorboard``.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord uses it."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return (
        length
        + struct.pack("<I", masked_crc32c(length))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf writes it (two's complement)
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(
    wall_time: float,
    step: int = 0,
    scalars: Mapping[str, float] | None = None,
    file_version: str | None = None,
) -> bytes:
    """One serialized ``Event``: wall_time (1), step (2), file_version (3), summary (5)."""
    out = bytearray(_varint(1 << 3 | 1) + struct.pack("<d", wall_time))
    out += _varint(2 << 3 | 0) + _varint(step)
    if file_version is not None:
        out += _field_bytes(3, file_version.encode())
    if scalars:
        summary = b"".join(
            # Summary.value (1) = Value{tag (1), simple_value (2, float)}
            _field_bytes(
                1, _field_bytes(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", v)
            )
            for tag, v in scalars.items()
        )
        out += _field_bytes(5, summary)
    return bytes(out)


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numbers of a (nested) metrics row as ``prefix/key[/sub]`` tags; booleans, strings
    and non-finite values are left out."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        tag = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, tag))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            if float(v) == float(v) and abs(float(v)) != float("inf"):
                out[tag] = float(v)
    return out


_WRITERS = itertools.count()


class ScalarWriter:
    """Appends scalars to a new event file in ``logdir`` (one file per writer, as
    TensorBoard expects: a restarted process starts a second file in the same folder)."""

    def __init__(self, logdir: Path) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        name = (
            f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.{next(_WRITERS)}"
        )
        self.path = logdir / name
        with self.path.open("ab") as f:
            f.write(tfrecord(event(now, file_version="brain.Event:2")))

    def write(
        self, step: int, scalars: Mapping[str, float], wall_time: float | None = None
    ) -> None:
        if not scalars:
            return
        record = tfrecord(event(time.time() if wall_time is None else wall_time, step, scalars))
        with self.path.open("ab") as f:  # each step's event whole, and on disk at once
            f.write(record)
