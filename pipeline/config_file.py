"""A configuration file read as the hostile input it may be.

Only a regular file of at most ``MAX_CONFIG_BYTES`` is read (not a link to ``/dev/zero``,
not a 2 GB file); YAML aliases are refused (a 1 KB "billion laughs" file expands to
gigabytes when written back or shown in an error); any number that is not finite or does
not fit 64 bits is refused wherever it stands, options passed through to environments
included; values shown in error messages are cut.
"""

from __future__ import annotations

import json
import math
import stat
from pathlib import Path
from typing import Any

from pipeline.errors import InvalidConfigError

#: the largest configuration file read (real ones are a few KB)
MAX_CONFIG_BYTES = 1 << 20
#: integers a setting may hold (a 64-bit signed integer)
MAX_INT = 2**63 - 1


def load_file(path: str | Path) -> dict[str, Any]:
    """The settings in a JSON or YAML (``.yaml``/``.yml``) file. A file is as hostile as
    any input: only a regular file of at most ``MAX_CONFIG_BYTES`` is read, YAML aliases
    (which expand a 1 KB file to gigabytes) are refused, and so is any number that is not
    finite or does not fit 64 bits, wherever it stands."""
    p = Path(path)
    try:
        if not stat.S_ISREG(p.stat().st_mode):
            raise InvalidConfigError(f"config file {p} is not a regular file")
        with p.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise InvalidConfigError(f"config file {p}: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise InvalidConfigError(
            f"config file {p} is larger than {MAX_CONFIG_BYTES >> 10} KiB: not a configuration"
        )
    text = raw.decode("utf-8", errors="replace")
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            data = _load_yaml(text)
        else:
            data = json.loads(text)
    except InvalidConfigError as e:
        raise InvalidConfigError(f"config file {p}: {e}") from None
    except Exception as e:  # a parser's own message says where
        raise InvalidConfigError(f"config file {p} does not parse: {str(e)[:300]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidConfigError(f"config file {p}: expected an object of settings")
    for key, value in data.items():
        _check_numbers(value, f"config file {p}: {str(key)[:60]}")
    return data


def _load_yaml(text: str) -> Any:
    import yaml

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.events.AliasEvent):
                mark = self.peek_event().start_mark
                raise InvalidConfigError(
                    f"a YAML alias at line {mark.line + 1}: rlstream does not expand aliases "
                    "(*name); write the value out"
                )
            return super().compose_node(parent, index)

    return yaml.load(text, Loader=Loader)


def _check_numbers(value: Any, where: str, depth: int = 0) -> None:
    """Refuses a number no setting can mean (NaN, infinity, beyond 64 bits) anywhere in
    ``value``, options passed through to environments included."""
    if depth > 100:
        raise InvalidConfigError(f"{where}: nested more than 100 levels deep")
    if isinstance(value, bool):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidConfigError(f"{where}: {value!r} is not a finite number")
    if isinstance(value, int) and abs(value) > MAX_INT:
        raise InvalidConfigError(f"{where}: {show(value)} does not fit a 64-bit integer")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_numbers(v, f"{where}.{str(k)[:60]}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_numbers(v, f"{where}[{i}]", depth + 1)


def show(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters for an error message."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**50 else "a huge integer"
    return text if len(text) <= limit else text[: limit - 3] + "..."
