"""Numpy arrays as ``rlstream.Tensor`` records: dtype, shape and raw little-endian bytes.

Readers get read-only arrays over the record's own bytes (``np.frombuffer``), writers
hand numpy's buffer to the encoder: no per-element Python work either way. The
:data:`SHORTCUT` writes and reads the usual case, a 1-D C-ordered array, without building
the record's fields (in the C codec too, see :class:`pipeline.records.avro_binary.Shortcut`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.errors import InvalidTrajectoryError, RecordDecodeError
from pipeline.records.avro_binary import read_long, write_long
from pipeline.records.avro_program import Shortcut
from pipeline.records.schema_store import default_store

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


def write_tensor_1d(out: bytearray, d: Any) -> bool:
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


def read_tensor_1d(buf: bytes, pos: int) -> tuple[np.ndarray, int] | None:
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


def tensor_fields(d: Any) -> tuple[Any, ...]:
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


def tensor_dict(array: np.ndarray) -> dict[str, Any]:
    dtype, shape, data = tensor_fields(array)
    return {"dtype": dtype, "shape": list(shape), "data": bytes(data)}


#: the 1-D tensor path of the Python and the C codec
SHORTCUT = Shortcut(write_tensor_1d, read_tensor_1d, ("tensor_1d", _DTYPE_LIST))
