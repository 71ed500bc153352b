"""Process-wide counters of connector events, by connector and reason.

Keys are ``<connector>/<reason>``: ``http/retry``, ``http/timeout``, ``http/http_503``,
``http/malformed``, ``http/oversized``, ``process/hung``, ``process/garbage``,
``process/died``, ``process/restart``, ``tool/calc/bad_arguments`` ... A producer puts a
snapshot into its status lines, so a run shows which environment misbehaves and how.
"""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_counters: Counter[str] = Counter()


def count(connector: str, reason: str, n: int = 1) -> None:
    with _lock:
        _counters[f"{connector}/{reason}"] += n


def snapshot() -> dict[str, int]:
    """The counters so far (a copy)."""
    with _lock:
        return dict(_counters)


def reset() -> None:
    with _lock:
        _counters.clear()
