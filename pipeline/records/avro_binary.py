"""Avro binary encoding, compiled from a schema into straight-line Python functions.

fastavro interprets the schema on every call, which costs about a microsecond per field;
rlstream's records have a few dozen fields around large byte payloads, so each schema's
writer and reader are generated once as Python source instead (one function per named
type, every primitive inlined, one-byte integers on a fast path).

Named record types can be mapped to Python types both ways: ``adapters[name](obj)``
returns the field values to write, in schema order, and ``factories[name](*values)``
builds the object read. ``shortcuts[name]`` is a :class:`Shortcut`, a pair of
hand-written functions tried first for the common shape of a type (``writer(out, obj) ->
bool``, ``reader(buf, pos) -> (obj, pos) | None``): when they decline, the generated code
runs. Records are otherwise written from dicts, tuples in field order, or objects with
attributes named like the fields, and read as dicts.

Where the C extension :mod:`pipeline.records._avro_native` was built (at install time,
with a C compiler), it runs the same writer and reader from a program of nodes
(:mod:`pipeline.records.avro_program`), about three times faster; the generated Python
is its reference (a test holds the two to the same bytes, values and refusals) and its
fallback. ``RLSTREAM_AVRO_NATIVE=0`` turns it off.

The reader is defensive: every length and count prefix is checked against the bytes that
are left, so corrupt input fails fast with :class:`RecordDecodeError` and never
allocates more than the input's size. Schema *resolution* (a writer schema that differs
from the reader's) is not done here; :mod:`pipeline.records.codec` hands that case to fastavro.
"""

from __future__ import annotations

import json
import operator
import struct
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from pipeline.errors import RecordDecodeError
from pipeline.records.avro_program import (
    Shortcut,
    native_available,
    native_program,
    union_branches,
)

_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1
_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1


def write_long(out: bytearray, n: int) -> None:
    """Append ``n`` as a zig-zag variable-length Avro long."""
    if not _LONG_MIN <= n <= _LONG_MAX:
        raise ValueError(f"{n} does not fit an Avro long")
    n = (n << 1) ^ (n >> 63)
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _write_int(out: bytearray, n: int) -> None:
    if not _INT_MIN <= n <= _INT_MAX:
        raise ValueError(f"{n} does not fit an Avro int")
    write_long(out, n)


def read_long(buf: bytes, pos: int) -> tuple[int, int]:
    """Read a zig-zag variable-length Avro long at ``pos``; return it and the new pos."""
    b = buf[pos]
    pos += 1
    n = b & 0x7F
    shift = 7
    while b & 0x80:
        if shift > 63:
            raise RecordDecodeError("invalid", "variable-length integer longer than 10 bytes")
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        shift += 7
    if n >> 64:  # the tenth byte holds bit 63 alone
        raise RecordDecodeError("invalid", "variable-length integer beyond 64 bits")
    return (n >> 1) ^ -(n & 1), pos


def _read_int(buf: bytes, pos: int) -> tuple[int, int]:
    n, pos = read_long(buf, pos)
    if not _INT_MIN <= n <= _INT_MAX:
        raise RecordDecodeError("invalid", f"{n} does not fit an Avro int")
    return n, pos


def _bad_length(what: str, size: int, left: int) -> NoReturn:
    if size < 0:
        raise RecordDecodeError("bad_length", f"negative {what} length {size}")
    raise RecordDecodeError("bad_length", f"{what} length {size} exceeds the {left} bytes left")


def _bad_enum(what: str, index: int) -> NoReturn:
    raise RecordDecodeError("bad_enum", f"{what} has no symbol or branch number {index}")


def _bad_bool(b: int) -> NoReturn:
    raise RecordDecodeError("invalid", f"boolean byte {b}")


def _bad_symbol(name: str, value: Any) -> NoReturn:
    raise ValueError(f"{value!r} is not a symbol of enum {name}")


_HELPERS: dict[str, Any] = {
    "_wlong": write_long,
    "_wint": _write_int,
    "_rlong": read_long,
    "_rint": _read_int,
    "_idx": operator.index,
    "_tuple_new": tuple.__new__,
    "_pack_d": struct.Struct("<d").pack,
    "_pack_f": struct.Struct("<f").pack,
    "_unpack_d": struct.Struct("<d").unpack_from,
    "_unpack_f": struct.Struct("<f").unpack_from,
    "_bad_length": _bad_length,
    "_bad_enum": _bad_enum,
    "_bad_bool": _bad_bool,
    "_bad_symbol": _bad_symbol,
}


class CompiledSchema:
    """Writer and reader of one schema, given by its parsing canonical form.

    ``encode(datum, prefix=b"") -> bytes`` and ``decode(buf, pos=0) -> (datum, end)``.
    ``native`` chooses the C extension (None: where it is available, see
    :func:`native_available`); :attr:`native` tells which one runs.
    """

    def __init__(
        self,
        canonical_form: str,
        adapters: Mapping[str, Callable[[Any], tuple[Any, ...]]] | None = None,
        factories: Mapping[str, Callable[..., Any]] | None = None,
        shortcuts: Mapping[str, Shortcut] | None = None,
        *,
        native: bool | None = None,
    ) -> None:
        schema = json.loads(canonical_form)
        gen = _Generator(dict(adapters or {}), dict(factories or {}), dict(shortcuts or {}))
        top = gen.named_type(schema)
        namespace = dict(_HELPERS, **gen.env)
        exec(compile("\n".join(gen.source), f"<avro {top}>", "exec"), namespace)
        self.source = "\n".join(gen.source)
        self._write: Callable[[bytearray, Any], None] = namespace[f"w_{top}"]
        self._read: Callable[[bytes, int], tuple[Any, int]] = namespace[f"r_{top}"]
        if native is None:
            native = native_available() and all(s.native for s in (shortcuts or {}).values())
        self._native: Any = None
        if native:
            self._native = native_program(schema, adapters or {}, factories or {}, shortcuts or {})

    @property
    def native(self) -> bool:
        """Whether the C extension runs this schema."""
        return self._native is not None

    def encode(self, datum: Any, prefix: bytes = b"") -> bytes:
        if self._native is not None:
            return self._native.encode(datum, bytes(prefix))
        out = bytearray(prefix)
        self._write(out, datum)
        return bytes(out)

    def decode(self, buf: bytes, pos: int = 0) -> tuple[Any, int]:
        try:
            if self._native is not None:
                return self._native.decode(buf if type(buf) is bytes else bytes(buf), pos)
            return self._read(buf, pos)
        except IndexError:
            raise RecordDecodeError("truncated", "the bytes end before the record") from None
        except struct.error:
            raise RecordDecodeError("truncated", "the bytes end inside a number") from None
        except UnicodeDecodeError as e:
            raise RecordDecodeError("invalid", f"string is not UTF-8 ({e.reason})") from None
        except RecordDecodeError:
            raise
        except Exception as e:  # whatever else the bytes provoke is still a bad record
            raise RecordDecodeError("invalid", f"{type(e).__name__}: {str(e)[:200]}") from None


class _Generator:
    """Emits one writer ``w_<T>(out, d)`` and one reader ``r_<T>(buf, pos)`` per named
    type; everything else is inlined into them."""

    def __init__(
        self, adapters: dict[str, Any], factories: dict[str, Any], shortcuts: dict[str, Any]
    ) -> None:
        self.adapters = adapters
        self.factories = factories
        self.shortcuts = shortcuts
        self.env: dict[str, Any] = {}
        self.source: list[str] = []
        self.ids: dict[str, str] = {}
        self.counter = 0

    def tmp(self, stem: str) -> str:
        self.counter += 1
        return f"_{stem}{self.counter}"

    def named_type(self, s: dict[str, Any]) -> str:
        """Generate functions for a record, enum or fixed; return its identifier."""
        ident = s["name"].replace(".", "_")
        self.ids[s["name"]] = ident
        kind = s["type"]
        if kind == "record":
            self._record(ident, s)
        elif kind == "enum":
            self._enum(ident, s)
        else:
            self._fixed(ident, s)
        return ident

    # ---- named types -----------------------------------------------------------------

    def _record(self, ident: str, s: dict[str, Any]) -> None:
        names = tuple(f["name"] for f in s["fields"])
        fields = [self.tmp("f") for _ in names]
        w = [f"def w_{ident}(out, d):"]
        r = [f"def r_{ident}(buf, pos):"]
        shortcut = self.shortcuts.get(s["name"])
        if shortcut is not None:  # (writer(out, d) -> handled, reader(buf, pos) -> (v, pos) | None)
            self.env[f"_sw_{ident}"], self.env[f"_sr_{ident}"] = shortcut.write, shortcut.read
            w.append(f"    if _sw_{ident}(out, d): return")
            r += [f"    _v = _sr_{ident}(buf, pos)", "    if _v is not None: return _v"]
        adapter = self.adapters.get(s["name"])
        if adapter is not None:
            self.env[f"_ad_{ident}"] = adapter
            w.append(f"    {', '.join(fields)}, = _ad_{ident}(d)")
        else:
            w.append("    if type(d) is dict:")
            w += [f"        {v} = d[{n!r}]" for v, n in zip(fields, names, strict=True)]
            w.append("    elif isinstance(d, tuple):")
            w.append(f"        {', '.join(fields)}, = d")
            w.append("    else:")
            w += [f"        {v} = d.{n}" for v, n in zip(fields, names, strict=True)]
        for f, v in zip(s["fields"], fields, strict=True):
            w += self.write(f["type"], v, "    ")
            r += self.read(f["type"], v, "    ")
        if not fields:
            w.append("    pass")
        factory = self.factories.get(s["name"])
        values = ", ".join(fields)
        if factory is None:
            pairs = ", ".join(f"{n!r}: {v}" for n, v in zip(names, fields, strict=True))
            r.append(f"    return {{{pairs}}}, pos")
        elif isinstance(factory, type) and issubclass(factory, tuple):
            self.env[f"_fac_{ident}"] = factory  # a NamedTuple: skip its Python __new__
            r.append(f"    return _tuple_new(_fac_{ident}, ({values},)), pos")
        else:
            self.env[f"_fac_{ident}"] = factory
            r.append(f"    return _fac_{ident}({values}), pos")
        self.source += w + r

    def _enum(self, ident: str, s: dict[str, Any]) -> None:
        symbols = list(s["symbols"])
        self.env[f"_sym_{ident}"] = tuple(symbols)
        self.env[f"_idx_{ident}"] = {sym: i for i, sym in enumerate(symbols)}
        self.env[f"_name_{ident}"] = s["name"]
        self.source += [
            f"def w_{ident}(out, d):",
            f"    i = _idx_{ident}.get(d)",
            "    if i is None:",
            f"        _bad_symbol(_name_{ident}, d)",
            "    _wlong(out, i)",
            f"def r_{ident}(buf, pos):",
            "    i, pos = _rlong(buf, pos)",
            f"    if not 0 <= i < {len(symbols)}:",
            f"        _bad_enum(_name_{ident}, i)",
            f"    return _sym_{ident}[i], pos",
        ]

    def _fixed(self, ident: str, s: dict[str, Any]) -> None:
        size = int(s["size"])
        self.source += [
            f"def w_{ident}(out, d):",
            f"    if len(d) != {size}:",
            f"        raise ValueError('fixed {s['name']} needs {size} bytes')",
            "    out += d",
            f"def r_{ident}(buf, pos):",
            f"    if pos + {size} > len(buf):",
            "        raise IndexError",
            f"    return buf[pos:pos + {size}], pos + {size}",
        ]

    # ---- inline writers --------------------------------------------------------------

    def write(self, s: Any, v: str, ind: str) -> list[str]:
        kind = s if isinstance(s, str) else s["type"] if isinstance(s, dict) else "union"
        if isinstance(s, str) and s in self.ids:
            ident = self.ids[s]
            if f"_sym_{ident}" in self.env:
                return self._write_enum(ident, v, ind)
            return [f"{ind}w_{ident}(out, {v})"]
        if kind == "enum":
            return self._write_enum(self.named_type(s), v, ind)
        if kind in ("record", "fixed"):
            return [f"{ind}w_{self.named_type(s)}(out, {v})"]
        if kind == "null":
            return [f"{ind}if {v} is not None: raise TypeError('null field given a value')"]
        if kind == "boolean":
            return [f"{ind}out.append(1 if {v} else 0)"]
        if kind in ("int", "long"):
            n = self.tmp("n")
            return [
                f"{ind}{n} = _idx({v})",
                f"{ind}if 0 <= {n} < 64: out.append({n} << 1)",
                f"{ind}else: _w{kind}(out, {n})",
            ]
        if kind == "float":
            return [f"{ind}out += _pack_f({v})"]
        if kind == "double":
            return [f"{ind}out += _pack_d({v})"]
        if kind in ("bytes", "string"):
            b = self.tmp("b")
            # a bytes default is a JSON string of code points 0-255 (Avro specification),
            # which fastavro's resolution hands over as it is
            conv = (
                f"{v}.encode('utf-8')"
                if kind == "string"
                else f"{v}.encode('latin-1') if type({v}) is str else {v}"
            )
            return [
                f"{ind}{b} = {conv}",
                f"{ind}if len({b}) < 64: out.append(len({b}) << 1)",
                f"{ind}else: _wlong(out, len({b}))",
                f"{ind}out += {b}",
            ]
        if kind == "array":
            x, c = self.tmp("x"), self.tmp("c")
            return [
                f"{ind}{c} = len({v})",
                f"{ind}if {c}:",
                f"{ind}    if {c} < 64: out.append({c} << 1)",
                f"{ind}    else: _wlong(out, {c})",
                f"{ind}    for {x} in {v}:",
                *self.write(s["items"], x, ind + "        "),
                f"{ind}out.append(0)",
            ]
        if kind == "map":
            k, x, c = self.tmp("k"), self.tmp("x"), self.tmp("c")
            return [
                f"{ind}{c} = len({v})",
                f"{ind}if {c}:",
                f"{ind}    if {c} < 64: out.append({c} << 1)",
                f"{ind}    else: _wlong(out, {c})",
                f"{ind}    for {k}, {x} in {v}.items():",
                *self.write("string", k, ind + "        "),
                *self.write(s["values"], x, ind + "        "),
                f"{ind}out.append(0)",
            ]
        if kind == "union":
            null, other = union_branches(s)
            return [
                f"{ind}if {v} is None: out.append({null << 1})",
                f"{ind}else:",
                f"{ind}    out.append({other << 1})",
                *self.write(s[other], v, ind + "    "),
            ]
        raise ValueError(f"unsupported Avro type {kind!r}")

    # ---- inline readers --------------------------------------------------------------

    def read(self, s: Any, v: str, ind: str) -> list[str]:
        kind = s if isinstance(s, str) else s["type"] if isinstance(s, dict) else "union"
        if isinstance(s, str) and s in self.ids:
            ident = self.ids[s]
            if f"_sym_{ident}" in self.env:
                return self._read_enum(ident, v, ind)
            return [f"{ind}{v}, pos = r_{ident}(buf, pos)"]
        if kind == "enum":
            return self._read_enum(self.named_type(s), v, ind)
        if kind in ("record", "fixed"):
            return [f"{ind}{v}, pos = r_{self.named_type(s)}(buf, pos)"]
        if kind == "null":
            return [f"{ind}{v} = None"]
        if kind == "boolean":
            return [
                f"{ind}{v} = buf[pos]",
                f"{ind}pos += 1",
                f"{ind}if {v} > 1: _bad_bool({v})",
                f"{ind}{v} = {v} == 1",
            ]
        if kind in ("int", "long"):
            # One- and two-byte integers (below 8192 in magnitude) are read inline.
            hi = self.tmp("h")
            return [
                f"{ind}{v} = buf[pos]",
                f"{ind}if {v} < 128:",
                f"{ind}    {v} = ({v} >> 1) ^ -({v} & 1)",
                f"{ind}    pos += 1",
                f"{ind}else:",
                f"{ind}    {hi} = buf[pos + 1]",
                f"{ind}    if {hi} < 128:",
                f"{ind}        {v} = ({v} & 127) | ({hi} << 7)",
                f"{ind}        {v} = ({v} >> 1) ^ -({v} & 1)",
                f"{ind}        pos += 2",
                f"{ind}    else: {v}, pos = _r{kind}(buf, pos)",
            ]
        if kind in ("float", "double"):
            size, fn = (4, "_unpack_f") if kind == "float" else (8, "_unpack_d")
            return [f"{ind}{v} = {fn}(buf, pos)[0]", f"{ind}pos += {size}"]
        if kind in ("bytes", "string"):
            n = self.tmp("n")
            conv = f"buf[pos:pos + {n}]"
            if kind == "string":
                conv = f"str({conv}, 'utf-8')"
            return [
                *self.read("long", n, ind),
                f"{ind}if {n} < 0 or {n} > len(buf) - pos:",
                f"{ind}    _bad_length({kind!r}, {n}, len(buf) - pos)",
                f"{ind}{v} = {conv}",
                f"{ind}pos += {n}",
            ]
        if kind in ("array", "map"):
            return self._read_blocks(s, kind, v, ind)
        if kind == "union":
            null, other = union_branches(s)
            i = self.tmp("i")
            return [
                *self.read("long", i, ind),
                f"{ind}if {i} == {null}: {v} = None",
                f"{ind}elif {i} == {other}:",
                *self.read(s[other], v, ind + "    "),
                f"{ind}else: _bad_enum('union', {i})",
            ]
        raise ValueError(f"unsupported Avro type {kind!r}")

    def _write_enum(self, ident: str, v: str, ind: str) -> list[str]:
        i = self.tmp("i")
        return [
            f"{ind}{i} = _idx_{ident}.get({v})",
            f"{ind}if {i} is None: _bad_symbol(_name_{ident}, {v})",
            f"{ind}out.append({i} << 1) if {i} < 64 else _wlong(out, {i})",
        ]

    def _read_enum(self, ident: str, v: str, ind: str) -> list[str]:
        count = len(self.env[f"_sym_{ident}"])
        return [
            *self.read("long", v, ind),
            f"{ind}if not 0 <= {v} < {count}: _bad_enum(_name_{ident}, {v})",
            f"{ind}{v} = _sym_{ident}[{v}]",
        ]

    def _read_blocks(self, s: dict[str, Any], kind: str, v: str, ind: str) -> list[str]:
        c, x, k = self.tmp("c"), self.tmp("x"), self.tmp("k")
        skip = self.tmp("s")
        # Every item of rlstream's schemas takes at least one byte, so a count larger than
        # the bytes left is corrupt: checking it bounds allocation by the input's size.
        count = [
            *self.read("long", c, ind + "    "),
            f"{ind}    if {c} < 0:",
            f"{ind}        {c} = -{c}",
            *self.read("long", skip, ind + "        "),
            f"{ind}    if {c} > len(buf) - pos: _bad_length({kind!r}, {c}, len(buf) - pos)",
            f"{ind}    if not {c}: break",
        ]
        if kind == "array":
            body = [*self.read(s["items"], x, ind + "        "), f"{ind}        {v}.append({x})"]
        else:
            body = [
                *self.read("string", k, ind + "        "),
                *self.read(s["values"], x, ind + "        "),
                f"{ind}        {v}[{k}] = {x}",
            ]
        return [
            f"{ind}{v} = {'[]' if kind == 'array' else '{}'}",
            f"{ind}while True:",
            *count,
            f"{ind}    for _ in range({c}):",
            *body,
        ]
