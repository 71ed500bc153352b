"""Kafka headers of a trajectory record: what a consumer can know without decoding it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pipeline.records.trajectory import Trajectory

H_SCHEMA = "rlstream.schema"
H_ENV = "rlstream.env"
H_GROUP = "rlstream.group"
H_VERSION_MIN = "rlstream.version.min"
H_VERSION_MAX = "rlstream.version.max"
H_TOKENS = "rlstream.tokens"


class TrajectoryHeaders(NamedTuple):
    """What a consumer can know of a trajectory record without decoding its value.

    Fields a record lacks (or carries malformed) are None.
    """

    schema: bytes | None
    env: str | None
    group_id: str | None
    min_version: int | None
    max_version: int | None
    num_tokens: int | None

    @classmethod
    def parse(cls, headers: Sequence[tuple[str, bytes | None]] | None) -> TrajectoryHeaders:
        h = {k: v for k, v in (headers or ()) if v is not None}
        return cls(
            schema=_hex(h.get(H_SCHEMA)),
            env=_text(h.get(H_ENV)),
            group_id=_text(h.get(H_GROUP)),
            min_version=_int(h.get(H_VERSION_MIN)),
            max_version=_int(h.get(H_VERSION_MAX)),
            num_tokens=_int(h.get(H_TOKENS)),
        )


def trajectory_headers(t: Trajectory, fingerprint: bytes) -> list[tuple[str, bytes]]:
    return [
        (H_SCHEMA, fingerprint.hex().encode()),
        (H_ENV, t.env.encode()),
        (H_GROUP, t.group_id.encode()),
        (H_VERSION_MIN, str(t.min_version).encode()),
        (H_VERSION_MAX, str(t.max_version).encode()),
        (H_TOKENS, str(t.num_tokens).encode()),
    ]


def _text(v: bytes | None) -> str | None:
    if v is None:
        return None
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _int(v: bytes | None) -> int | None:
    if v is None or len(v) > 20:
        return None
    try:
        return int(v)
    except ValueError:
        return None


def _hex(v: bytes | None) -> bytes | None:
    if v is None or len(v) != 16:
        return None
    try:
        return bytes.fromhex(v.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
