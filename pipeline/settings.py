"""Configuration: one frozen dataclass per process, its defaults written once.

Every setting of a process is a field of a frozen dataclass (nested dataclasses are
sections), with its default and a ``#:`` comment that documents it. From those fields
come, with nothing written twice:

- command-line flags: ``--name`` for a top-level field, ``--section.name`` for a field of
  a section, plus the short names a class lists in ``FLAGS`` (``--temperature`` for
  ``sampling.temperature``); help text from the field's comment, its default shown;
- ``--config FILE`` (JSON, or YAML by its suffix): any field, sections as objects;
- the resolved configuration a process prints (``rlstream config show``) or writes next to
  its output, which ``--config`` reads back to the same value.

Precedence: a flag given on the command line, then an environment variable the class
lists in ``ENV``, then the file, then the default. An unknown key, a value of the wrong
type or a file that does not parse is an :class:`InvalidConfigError` naming the key.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import json
import math
import os
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pipeline.config_file import MAX_INT, load_file, show
from pipeline.errors import InvalidConfigError

T = TypeVar("T")


# ---- reading the classes -----------------------------------------------------------------


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's ``#:`` comment (the lines right above it), joined into one line."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            lines, _ = inspect.getsourcelines(klass)
        except (OSError, TypeError):
            continue
        tree = ast.parse(textwrap.dedent("".join(lines)))
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node in body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                comment: list[str] = []
                i = node.lineno - 2  # the line above, 0-based
                while i >= 0 and lines[i].strip().startswith("#:"):
                    comment.insert(0, lines[i].strip()[2:].strip())
                    i -= 1
                if comment:
                    docs[node.target.id] = " ".join(comment)
    return docs


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _optional(tp: Any) -> tuple[Any, bool]:
    """``(X, True)`` for ``X | None``, else ``(tp, False)``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _section(tp: Any) -> type | None:
    """The dataclass a field of type ``tp`` holds (a section), if it is one."""
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


# ---- values: from JSON-like data to fields, and back -------------------------------------


def _unknown(key: str, known: Sequence[str], where: str) -> InvalidConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return InvalidConfigError(
        f"{where}: unknown setting {key!r}{hint}; known: {', '.join(sorted(known))}"
    )


def coerce(tp: Any, value: Any, where: str) -> Any:
    """``value`` (from JSON, YAML or a flag) as a value of type ``tp``."""
    inner, optional = _optional(tp)
    if value is None:
        if optional or tp is Any:
            return None
        raise InvalidConfigError(f"{where}: must not be null")
    tp = inner
    if tp is Any:
        return value
    section = _section(tp)
    if section is not None:
        if isinstance(value, section):
            return value
        if isinstance(value, str) and hasattr(section, "from_name"):
            return section.from_name(value)
        return from_mapping(section, value, where)
    origin = typing.get_origin(tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
    elif tp is int:
        number_ = None
        if isinstance(value, int) and not isinstance(value, bool):
            number_ = value
        elif isinstance(value, str):
            try:
                number_ = int(value)
            except ValueError:
                pass
        if number_ is not None:
            if abs(number_) > MAX_INT:
                raise InvalidConfigError(f"{where}: {show(value)} does not fit a 64-bit integer")
            return number_
    elif tp is float:
        number = None
        try:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                number = float(value)
            elif isinstance(value, str):
                number = float(value)
        except (ValueError, OverflowError):
            number = math.inf if isinstance(value, int) else None
        if number is not None:
            if not math.isfinite(number):  # no setting means anything by NaN or infinity
                raise InvalidConfigError(f"{where}: {show(value)} is not a finite number")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
    elif origin is tuple:
        args = typing.get_args(tp)
        if isinstance(value, (list, tuple)):
            item = args[0] if args else Any
            return tuple(coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    elif origin in (Mapping, dict):
        args = typing.get_args(tp)
        if isinstance(value, Mapping):
            item = args[1] if len(args) == 2 else Any
            return {str(k): coerce(item, v, f"{where}.{k}") for k, v in value.items()}
    else:
        return value
    raise InvalidConfigError(f"{where}: {show(value)} is not a {_type_name(tp)}")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) in (Mapping, dict):
        return "mapping"
    return {bool: "boolean", int: "integer", float: "number", str: "string", Path: "path"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def from_mapping(cls: type[T], data: Any, where: str | None = None) -> T:
    """An instance of ``cls`` from a mapping of its fields (sections as mappings);
    missing fields keep their defaults."""
    where = where or cls.__name__
    if not isinstance(data, Mapping):
        raise InvalidConfigError(f"{where}: expected an object of settings, got {data!r:.80}")
    known = {f.name: f for f in _fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            raise _unknown(str(key), list(known), where)
        kwargs[key] = coerce(_hints(cls)[key], value, f"{where}.{key}")  # type: ignore[arg-type]
    try:
        return cls(**kwargs)
    except InvalidConfigError as e:
        raise InvalidConfigError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise InvalidConfigError(f"{where}: {e}") from None


def to_mapping(cfg: Any) -> dict[str, Any]:
    """``cfg`` as JSON-ready data that :func:`from_mapping` reads back to an equal value."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(getattr(v, f.name)) for f in _fields(type(v))}
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, Mapping):
            return {str(k): plain(x) for k, x in v.items()}
        return v

    out = plain(cfg)
    assert isinstance(out, dict)
    return out


def write_file(cfg: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_mapping(cfg), indent=2, sort_keys=True) + "\n")
    return path


# ---- flags ---------------------------------------------------------------------------------


def leaf_paths(cls: type, prefix: str = "") -> dict[str, tuple[Any, dataclasses.Field[Any]]]:
    """Every setting of ``cls`` by dotted path (``grpo.learning_rate``), sections included."""
    out: dict[str, tuple[Any, dataclasses.Field[Any]]] = {}
    for f in _fields(cls):
        tp = _hints(cls)[f.name]
        path = prefix + f.name
        out[path] = (tp, f)
        section = _section(_optional(tp)[0])
        if section is not None:
            out.update(leaf_paths(section, path + "."))
    return out


def _owner_docs(cls: type, path: str) -> str:
    parts = path.split(".")
    owner = cls
    for part in parts[:-1]:
        owner = _section(_optional(_hints(owner)[part])[0]) or owner
    return field_docs(owner).get(parts[-1], "")


def _flag_type(tp: Any, where: str) -> Any:
    inner, optional = _optional(tp)

    def parse(text: str) -> Any:
        if optional and text.lower() in ("none", "null"):
            return None
        try:
            return coerce(inner, text, where)
        except InvalidConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = _type_name(inner)
    return parse


def parse_item(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def add_flags(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    """A flag for every setting of ``cls`` (and each alias in ``cls.FLAGS``); a flag not
    given leaves nothing in the parsed namespace, so that the file and defaults apply."""
    group = parser.add_argument_group(title or "settings (any of them also in --config FILE)")
    group.add_argument(
        "--config",
        dest="_config_file",
        default=None,
        metavar="FILE",
        help="settings from a JSON or YAML file (flags given here override it)",
    )
    aliases: Mapping[str, str | Sequence[str]] = getattr(cls, "FLAGS", {})
    env: Mapping[str, str] = getattr(cls, "ENV", {})
    alias_of: dict[str, str] = {}
    multi = {short for short, target in aliases.items() if not isinstance(target, str)}
    for short, target in aliases.items():
        if isinstance(target, str):
            alias_of.setdefault(target, short)
    defaults: Any = resolve(cls, {}, environ={})
    flat = _flatten(to_mapping(defaults))
    for path, (tp, _f) in leaf_paths(cls).items():
        inner, _ = _optional(tp)
        if _section(inner) is not None and not hasattr(inner, "from_name"):
            continue
        names = [] if path in multi else [f"--{path.replace('_', '-')}"]
        alias = alias_of.get(path)
        if alias is not None and alias != path:
            names.insert(0, f"--{alias.replace('_', '-')}")
        if not names:
            continue
        _add_flag(group, cls, names, path, tp, flat.get(path), env.get(path))
    for short, target in aliases.items():  # an alias for several settings at once
        if not isinstance(target, str):
            tp = leaf_paths(cls)[target[0]][0]
            help_text = f"sets {', '.join(target)} together"
            _add_flag(
                group, cls, [f"--{short.replace('_', '-')}"], "@" + short, tp, None, None, help_text
            )


def _add_flag(
    group: Any,
    cls: type,
    names: list[str],
    dest: str,
    tp: Any,
    default: Any,
    env_var: str | None,
    help_text: str | None = None,
) -> None:
    inner, _ = _optional(tp)
    doc = (help_text or _owner_docs(cls, dest) or "").replace("``", "")
    if dest.startswith("@") or "(default:" in doc:  # the doc says what the default is
        shown = ""
    else:
        shown = f"default: {default!r}"
    if env_var:
        shown = f"env {env_var}; {shown}"
    full = f"{doc} ({shown})" if doc and shown else doc or f"({shown})"
    full = full.replace("%", "%%")
    origin = typing.get_origin(inner)
    kw: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": full}
    if inner is bool:
        group.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
    elif origin is tuple:
        item = typing.get_args(inner)[0]
        group.add_argument(
            *names, action="append", type=_flag_type(item, dest), metavar="VALUE", **kw
        )
    elif origin in (Mapping, dict):
        group.add_argument(*names, action="append", type=parse_item, metavar="KEY=VALUE", **kw)
    else:
        metavar = "NAME" if _section(inner) is not None else _type_name(inner).upper()
        group.add_argument(*names, type=_flag_type(tp, dest), metavar=metavar, **kw)


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        out[prefix + k] = v
        if isinstance(v, Mapping):
            out.update(_flatten(v, prefix + k + "."))
    return out


def _set(cls: type, data: dict[str, Any], path: str, value: Any) -> None:
    """Set ``path`` in nested ``data``; a section given by name (a preset) is expanded."""
    parts = path.split(".")
    owner: Any = cls
    node = data
    for part in parts[:-1]:
        section = _section(_optional(_hints(owner)[part])[0])
        current = node.get(part)
        if isinstance(current, str) and section is not None and hasattr(section, "from_name"):
            current = to_mapping(section.from_name(current))
        elif dataclasses.is_dataclass(current) and not isinstance(current, type):
            current = to_mapping(current)
        if not isinstance(current, dict):
            current = {}
        node[part] = current
        node = current
        owner = section
    node[parts[-1]] = value


def resolve(
    cls: type[T],
    given: Mapping[str, Any] | argparse.Namespace,
    *,
    file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """The frozen config: defaults < ``file`` < environment variables (``cls.ENV``) <
    ``given`` (flags parsed by :func:`add_flags`, or a mapping of dotted paths)."""
    if isinstance(given, argparse.Namespace):
        values = dict(vars(given))
        file = file or values.pop("_config_file", None)
    else:
        values = dict(given)
    data: dict[str, Any] = load_file(file) if file else {}
    paths = leaf_paths(cls)
    env = os.environ if environ is None else environ
    for path, var in getattr(cls, "ENV", {}).items():
        if env.get(var):
            raw = env[var]
            tp = _optional(paths[path][0])[0]
            _set(cls, data, path, [raw] if typing.get_origin(tp) is tuple else raw)
    aliases: Mapping[str, str | Sequence[str]] = getattr(cls, "FLAGS", {})
    for dest in sorted(values, key=lambda d: d.count(".")):  # sections before their fields
        value = values[dest]
        targets: Sequence[str]
        if dest.startswith("@"):
            target = aliases[dest[1:]]
            targets = [target] if isinstance(target, str) else target
        elif dest in paths:
            targets = [dest]
        else:
            continue  # not a setting (the cluster, --json ...)
        for path in targets:
            tp = _optional(paths[path][0])[0]
            if typing.get_origin(tp) in (Mapping, dict) and isinstance(value, list):
                merged = dict(_get(data, path) or {})
                merged.update(dict(value))
                value = merged
            _set(cls, data, path, value)
    return from_mapping(cls, data, cls.__name__)


def _get(data: Mapping[str, Any], path: str) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node
