"""The C codec's side in Python: whether it is built, and its program for a schema.

:mod:`pipeline.records._avro_native` (C) runs Avro writers and readers from a *program*:
one node per type, ``(kind, ...)`` tuples naming other nodes by index (``init_node`` in
``_avro_native.c`` reads them). :func:`native_program` builds it from a schema's parsing
canonical form, with the same adapters, factories and shortcuts as
:class:`pipeline.records.avro_binary.CompiledSchema`, whose generated Python is the
reference and the fallback.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from pipeline.errors import RecordDecodeError

try:
    from pipeline.records import _avro_native  # type: ignore[attr-defined]
except ImportError:  # installed without a C compiler: the generated Python alone
    _avro_native = None
else:
    _avro_native.configure(RecordDecodeError)


class Shortcut(NamedTuple):
    """Hand-written writer and reader of the common shape of one named type.

    ``native``, when given, names the same shortcut in the C extension (only
    ``("tensor_1d", dtypes)``: 1-D numpy arrays as ``rlstream.Tensor`` records, the
    dtypes in the order of the Dtype enum's symbols); a schema with a shortcut the C
    extension lacks runs in Python.
    """

    write: Callable[[bytearray, Any], bool]
    read: Callable[[bytes, int], tuple[Any, int] | None]
    native: tuple[str, Sequence[Any]] | None = None


def native_enabled() -> bool:
    """Whether the C paths of the records are allowed (not ``RLSTREAM_AVRO_NATIVE=0``)."""
    return os.environ.get("RLSTREAM_AVRO_NATIVE", "1") != "0"


def native_available() -> bool:
    """Whether the C codec is built and not turned off (``RLSTREAM_AVRO_NATIVE=0``)."""
    return _avro_native is not None and native_enabled()


def union_branches(s: list[Any]) -> tuple[int, int]:
    """The null branch of a two-branch union and the other one (the only unions rlstream
    writes)."""
    if len(s) != 2 or "null" not in s:
        raise ValueError("only unions of null and one other type are supported")
    null = s.index("null")
    return null, 1 - null


def native_program(
    schema: Any,
    adapters: Mapping[str, Any],
    factories: Mapping[str, Any],
    shortcuts: Mapping[str, Shortcut],
) -> Any:
    """The C writer and reader of ``schema`` (``encode(datum, prefix) -> bytes``,
    ``decode(buf, pos) -> (datum, end)``). Raises RuntimeError where it is not built."""
    if _avro_native is None:
        raise RuntimeError("the C extension pipeline.records._avro_native is not built")
    nodes, root = _Program(adapters, factories, shortcuts).build(schema)
    return _avro_native.Program(nodes, root)


class _Program:
    """The nodes of :class:`pipeline.records._avro_native.Program`: one tuple per type,
    ``(kind, ...)``, naming other nodes by their index (see ``init_node`` in
    ``_avro_native.c``); every use of a named type refers to its one node."""

    PRIMITIVES = ("null", "boolean", "int", "long", "float", "double", "string", "bytes")

    def __init__(
        self,
        adapters: Mapping[str, Any],
        factories: Mapping[str, Any],
        shortcuts: Mapping[str, Shortcut],
    ) -> None:
        self.adapters, self.factories, self.shortcuts = adapters, factories, shortcuts
        self.nodes: list[tuple[Any, ...]] = []
        self.named: dict[str, int] = {}

    def build(self, schema: Any) -> tuple[tuple[tuple[Any, ...], ...], int]:
        root = self.node(schema)
        return tuple(self.nodes), root

    def _kind(self, name: str) -> int:
        return int(getattr(_avro_native, f"K_{name.upper()}"))

    def _add(self, node: tuple[Any, ...]) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def node(self, s: Any) -> int:
        if isinstance(s, str):
            if s in self.named:
                return self.named[s]
            if s not in self.PRIMITIVES:
                raise ValueError(f"unsupported Avro type {s!r}")
            return self._add((self._kind(s),))
        if isinstance(s, list):
            null, other = union_branches(s)
            i = self._add(())
            self.nodes[i] = (self._kind("union"), null, self.node(s[other]))
            return i
        kind = s["type"]
        if kind in self.PRIMITIVES:
            return self._add((self._kind(kind),))
        if kind in ("array", "map"):
            i = self._add(())
            child = self.node(s["items" if kind == "array" else "values"])
            self.nodes[i] = (self._kind(kind), child)
            return i
        name = s["name"]
        i = self.named[name] = self._add(())
        if kind == "enum":
            symbols = tuple(s["symbols"])
            self.nodes[i] = (self._kind(kind), name, symbols, {x: k for k, x in enumerate(symbols)})
        elif kind == "fixed":
            self.nodes[i] = (self._kind(kind), name, int(s["size"]))
        elif kind == "record":
            fields = tuple(self.node(f["type"]) for f in s["fields"])
            factory = self.factories.get(name)
            self.nodes[i] = (
                self._kind(kind),
                name,
                tuple(f["name"] for f in s["fields"]),
                fields,
                self.adapters.get(name),
                factory,
                isinstance(factory, type) and issubclass(factory, tuple),
                self._tensor(self.shortcuts.get(name)),
            )
        else:
            raise ValueError(f"unsupported Avro type {kind!r}")
        return i

    @staticmethod
    def _tensor(shortcut: Shortcut | None) -> tuple[Any, ...] | None:
        if shortcut is None:
            return None
        if shortcut.native is None or shortcut.native[0] != "tensor_1d":
            raise ValueError(f"the C extension has no shortcut {shortcut.native!r}")
        import numpy as np

        dtypes = tuple(shortcut.native[1])
        return (
            dtypes,
            {dt: k for k, dt in enumerate(dtypes)},
            tuple(dt.itemsize for dt in dtypes),
            np.ndarray,
            np.frombuffer,
        )
