"""The safetensors file format, read memory-mapped and checked, and written.

A file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the data. :func:`read_header` checks everything the header
claims against the file itself (a truncated file, ranges that overlap or run past the
end, sizes that disagree with the shape) before a byte of data is touched;
:func:`tensor` then maps one tensor without reading the rest.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from pipeline.errors import InvalidConfigError

#: safetensors dtype names rlstream reads and writes
DTYPES: dict[str, Any] = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    path: Path
    data_start: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def _bad(path: Path, why: str) -> InvalidConfigError:
    return InvalidConfigError(f"{path.name} is not a usable safetensors file: {why}")


def read_header(path: Path) -> Header:
    """The checked header of the safetensors file ``path``."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _bad(path, f"{size} bytes, shorter than its header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise _bad(path, f"header length {n} runs past the file ({size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise InvalidConfigError(f"{path} cannot be read: {e.strerror}") from None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise _bad(path, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise _bad(path, "its header is not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise _bad(path, "its __metadata__ is not an object")
    data_start, available = 8 + n, size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            raise _bad(path, f"entry {name!r} is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPES:
            raise _bad(path, f"tensor {name!r} has dtype {dtype!r} (rlstream reads {list(DTYPES)})")
        if not (
            isinstance(shape, list)
            and all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape
            )
        ):
            raise _bad(path, f"tensor {name!r} has shape {shape!r}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise _bad(path, f"tensor {name!r} has data_offsets {offsets!r}")
        begin, end = offsets
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if not 0 <= begin <= end or end - begin != want:
            raise _bad(
                path, f"tensor {name!r} spans [{begin}, {end}), not the {want} bytes of its shape"
            )
        if end > available:
            raise _bad(
                path, f"tensor {name!r} ends at byte {end} of {available} (the file is truncated)"
            )
        tensors[name] = TensorInfo(dtype, tuple(shape), begin, end)
    spans = sorted((t.begin, t.end, k) for k, t in tensors.items() if t.end > t.begin)
    for (_, end_a, a), (begin_b, _, b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise _bad(path, f"tensors {a!r} and {b!r} overlap")
    return Header(path, data_start, tensors, {str(k): str(v) for k, v in metadata.items()})


def all_finite(header: Header, name: str, chunk: int = 1 << 24) -> bool:
    """Whether tensor ``name`` holds no NaN or infinity (read in chunks of ``chunk``
    items, so that a large tensor never needs a second copy in memory)."""
    flat = tensor(header, name).reshape(-1)
    return all(
        bool(np.isfinite(flat[i : i + chunk].astype(np.float32)).all())
        for i in range(0, flat.shape[0], chunk)
    )


def tensor(header: Header, name: str) -> np.ndarray:
    """Tensor ``name`` of a checked file, memory-mapped (read only)."""
    info = header.tensors[name]
    dtype = DTYPES[info.dtype]
    if info.end == info.begin:
        return np.zeros(info.shape, dtype)
    return np.memmap(
        header.path, dtype=dtype, mode="r", offset=header.data_start + info.begin, shape=info.shape
    )


def write(
    path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> None:
    """Write ``tensors`` (C order, by sorted name) as a safetensors file at ``path``."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        a = tensors[name]
        if a.dtype not in _NAMES:
            raise InvalidConfigError(
                f"tensor {name!r} has dtype {a.dtype}, not one safetensors holds"
            )
        header[name] = {
            "dtype": _NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name]).tobytes())
