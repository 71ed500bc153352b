"""A Kafka message read exactly once into plain values.

confluent-kafka's ``Message`` converts its headers from C on the first ``headers()``
call. A header whose name is not UTF-8 makes that call raise (``SystemError``) and leaves
the message half-converted: a second call returns a header whose name is a NULL pointer,
and touching it kills the process (a segmentation fault, at every restart on the same
offset); called from Python code, the failure may not even raise where it happens
(see ``_headers``). So every component that reads records from Kafka turns each message into a
:class:`Record` once, right after it was consumed, keeping the headers or the reason
they could not be read, and never calls back into the client for that message.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

#: ``m.headers()`` called through the C API, which checks the result: called in Python
#: code, CPython's specialised call of a C method (after a few calls of the same line)
#: does not check it, and a failed conversion then returns a half-built list while its
#: error stays pending, to be raised by whatever runs next
_headers = operator.methodcaller("headers")


@dataclass(frozen=True, slots=True)
class Record:
    """Where a record lies, its key, value and headers, read once. ``header_error``
    says why the headers could not be read (then ``headers`` is empty)."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...] = ()
    header_error: str | None = None

    @classmethod
    def of(cls, m: Any) -> Record:
        """The record of a consumed message (one that carries no error); each of its
        accessors is called once."""
        try:
            headers = tuple(_headers(m) or ())
            error = None
        except Exception as e:  # e.g. a header name that is not UTF-8
            headers, error = (), f"{type(e).__name__}: {str(e)[:200]}"
        return cls(
            topic=m.topic(),
            partition=m.partition(),
            offset=m.offset() or 0,
            timestamp_ms=m.timestamp()[1],
            key=m.key(),
            value=m.value(),
            headers=headers,
            header_error=error,
        )

    def header_dict(self) -> dict[str, bytes]:
        """The headers with a value, by name (the last of a repeated name wins)."""
        return {k: v for k, v in self.headers if v is not None}
