"""Messages of the remote environment protocol (version 1), shared by the HTTP and the
subprocess connectors and by ``rlstream env serve``; documented in
``docs/environment-protocol.md``.

Everything received is parsed as JSON into plain values and checked field by field
before use; nothing is evaluated or unpickled, and messages are bounded in size.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from connectors.base import SeedTask, Step, Task
from pipeline.errors import RlstreamError

PROTOCOL_VERSION = 1
#: default bound of one message (a response body or a JSON line)
MAX_MESSAGE_BYTES = 1 << 20
#: most characters of an observation or tool result taken from a remote environment
MAX_TEXT_CHARS = 64 * 1024


class ConnectorError(RlstreamError):
    """A remote environment failed this call for good (after any retries): the episode
    ends with ``env_error``. ``reason`` is a stable label (also a counter)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class RemoteError(ConnectorError):
    """The environment answered with a protocol error ``{"error": {code, message}}``."""

    def __init__(self, code: str, message: str, status: int = 0) -> None:
        super().__init__(code, message)
        self.code = code
        self.status = status


def parse_object(raw: bytes | str, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """A JSON object of at most ``max_bytes`` (NaN and infinities refused), or
    :class:`ConnectorError` (``oversized``, ``malformed``)."""
    if len(raw) > max_bytes:
        raise ConnectorError("oversized", f"message of {len(raw)} bytes (limit {max_bytes})")
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        msg = json.loads(text, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError) as e:
        raise ConnectorError("malformed", f"not JSON: {str(e)[:200]}") from None
    if not isinstance(msg, dict):
        raise ConnectorError("malformed", f"not a JSON object but {type(msg).__name__}")
    return msg


def decode(raw: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """One message: a JSON object of this protocol's version, or :class:`ConnectorError`
    (``oversized``, ``malformed``, ``version``)."""
    msg = parse_object(raw, max_bytes)
    version = msg.get("version")
    if type(version) is not int or version != PROTOCOL_VERSION:  # (True == 1 in Python)
        raise ConnectorError(
            "version", f"protocol version {msg.get('version')!r}, expected {PROTOCOL_VERSION}"
        )
    return msg


def encode(msg: Mapping[str, Any]) -> bytes:
    return json.dumps({"version": PROTOCOL_VERSION, **msg}, allow_nan=False).encode()


def error(code: str, message: str) -> dict[str, Any]:
    return {"version": PROTOCOL_VERSION, "error": {"code": code, "message": message[:1000]}}


def raise_if_error(msg: Mapping[str, Any], status: int = 0) -> None:
    """Raise the :class:`RemoteError` a message carries, if it carries one."""
    err = msg.get("error")
    if err is None:
        return
    if not isinstance(err, dict):
        raise ConnectorError("malformed", "error is not an object")
    code, text = err.get("code"), err.get("message", "")
    raise RemoteError(str(code)[:100], str(text)[:1000], status)


def text(msg: Mapping[str, Any], key: str, limit: int = MAX_TEXT_CHARS) -> str:
    value = msg.get(key)
    if not isinstance(value, str):
        raise ConnectorError("malformed", f"{key} is not a string")
    if len(value) > limit:
        raise ConnectorError("oversized", f"{key} of {len(value)} characters (limit {limit})")
    return value


def integer(msg: Mapping[str, Any], key: str) -> int:
    value = msg.get(key)
    if type(value) is not int:
        raise ConnectorError("malformed", f"{key} is not an integer")
    return value


def step_of(msg: Mapping[str, Any]) -> Step:
    """A :class:`Step` from a step response."""
    reward = msg.get("reward", 0.0)
    if type(reward) not in (int, float) or not math.isfinite(reward):
        raise ConnectorError("malformed", f"reward {reward!r} is not a finite number")
    done = msg.get("done")
    if type(done) is not bool:
        raise ConnectorError("malformed", "done is not a boolean")
    info = msg.get("info", {})
    if not isinstance(info, dict):
        raise ConnectorError("malformed", "info is not an object")
    return Step(text(msg, "observation"), float(reward), done, info)


def step_message(step: Step) -> dict[str, Any]:
    return {
        "observation": step.observation,
        "reward": float(step.reward),
        "done": bool(step.done),
        "info": plain(step.info),
    }


def task_message(task: Task) -> dict[str, Any]:
    """The task part of a reset request: a seed or an explicit task."""
    if isinstance(task, SeedTask):
        return {"seed": task.seed}
    return {"task": {"task_id": task.task_id, "params": plain(task.params)}}


def task_of(msg: Mapping[str, Any]) -> Task | int:
    """The task of a reset request, or its seed."""
    if "seed" in msg:
        return integer(msg, "seed")
    task = msg.get("task")
    if not isinstance(task, dict) or not isinstance(task.get("params", {}), dict):
        raise ConnectorError("malformed", "a reset needs a seed or a task object")
    return Task(text(task, "task_id", 1000), task.get("params", {}))


def plain(value: Any, depth: int = 0) -> Any:
    """``value`` as plain JSON data (str, finite numbers, bools, None, lists, objects);
    anything else becomes its ``repr``."""
    if depth > 16:
        return repr(value)[:200]
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v, depth + 1) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return plain(value.item(), depth + 1)
    return repr(value)[:200]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
