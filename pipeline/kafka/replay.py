"""Recordings: a namespace's trajectories in an Avro object container file, with their
Kafka coordinates, to inspect, to publish again elsewhere, or to train from.

A recording is a standard Avro container file (deflate-compressed blocks) of
``rlstream.RecordedTrajectory`` records; any Avro library reads it. Records are read back
block by block, so a damaged file yields every record before the damage and then a
:class:`RecordingError` naming the block.

:class:`RecordingSource` serves a recording to the trainer through the part of the Kafka
consumer interface the trainer uses, so ``rlstream train --from-file`` runs the same code
as training from Kafka, deterministically (file order, no clocks).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import confluent_kafka
import fastavro

from pipeline.errors import RecordDecodeError, RlstreamError
from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.message import Record
from pipeline.kafka.topics import env_of, rollout_topics
from pipeline.kafka.transport import read_ranges
from pipeline.records.codec import TrajectoryCodec, to_avro_dict
from pipeline.records.container import ContainerError, NotAContainerError, read_blocks
from pipeline.records.schema_store import default_store
from pipeline.records.trajectory import Trajectory

RECORD = "RecordedTrajectory"


class RecordingError(RlstreamError):
    """A recording that cannot be read (from the named block on)."""


@dataclass
class Recorded:
    """One recorded Kafka record: coordinates, and the trajectory or why it failed."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None = None
    headers: dict[str, bytes] = field(default_factory=dict)
    trajectory: Trajectory | None = None
    raw: bytes | None = None
    error: str | None = None

    @property
    def env(self) -> str:
        return self.trajectory.env if self.trajectory else (env_of(self.topic) or "?")


def recording_schema() -> Any:
    return default_store().reader(RECORD).parsed


# ---- record -------------------------------------------------------------------------


@dataclass
class RecordStats:
    records: int = 0
    undecodable: int = 0
    bytes: int = 0
    partitions: dict[str, tuple[int, int]] = field(default_factory=dict)


def parse_bound(text: str | None) -> tuple[str, int] | None:
    """``--from``/``--to``: an offset (``1234``), Unix epoch milliseconds (``ms:...``)
    or an ISO time (``2026-11-30T01:00:00``, UTC unless it says otherwise)."""
    if text is None:
        return None
    if text.isdigit():
        return "offset", int(text)
    if text.startswith("ms:") and text[3:].isdigit():
        return "time", int(text[3:])
    from datetime import UTC, datetime

    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise RlstreamError(
            f"{text!r} is neither an offset, ms:<epoch millis> nor an ISO time"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return "time", int(moment.timestamp() * 1000)


def record(
    kafka: KafkaConfig,
    namespace: str,
    out: Path,
    envs: Sequence[str] = (),
    start: tuple[str, int] | None = None,
    end: tuple[str, int] | None = None,
    progress: Callable[[RecordStats, int], None] | None = None,
) -> RecordStats:
    """Write the namespace's rollout records in ``[start, end)`` (per partition) to
    ``out``. Reads with partitions assigned directly: it joins no group and commits
    nothing. Stops at each partition's end as it was when recording began."""
    topics = rollout_topics(kafka, namespace)
    if envs:
        missing = sorted(set(envs) - set(topics))
        if missing:
            raise RlstreamError(f"namespace {namespace!r} has no rollout topic for {missing}")
        topics = {e: t for e, t in topics.items() if e in envs}
    if not topics:
        raise RlstreamError(f"namespace {namespace!r} has no rollout topics")
    consumer = kafka.consumer(
        f"{namespace}.replay.{uuid.uuid4().hex[:8]}", **{"enable.partition.eof": False}
    )
    stats = RecordStats()
    try:
        ranges = _ranges(consumer, topics.values(), start, end)
        total = sum(b - a for a, b in ranges.values())
        stats.partitions = {f"{t}:{p}": r for (t, p), r in ranges.items()}
        codec = TrajectoryCodec()

        def records() -> Iterator[dict[str, Any]]:
            last = time.monotonic()
            for m in read_ranges(consumer, ranges):
                stats.records += 1
                stats.bytes += len(m.value or b"")
                yield _recorded_dict(m, codec, stats)
                if progress and time.monotonic() - last > 1.0:
                    last = time.monotonic()
                    progress(stats, total)

        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".part")
        with tmp.open("wb") as f:
            fastavro.writer(f, recording_schema(), records(), codec="deflate")
        tmp.replace(out)
        if progress:
            progress(stats, total)
    finally:
        consumer.close()
    return stats


def _ranges(
    consumer: Any,
    topics: Any,
    start: tuple[str, int] | None,
    end: tuple[str, int] | None,
) -> dict[tuple[str, int], tuple[int, int]]:
    md = consumer.list_topics(timeout=10)
    out = {}
    for topic in topics:
        for p in sorted(md.topics[topic].partitions):
            low, high = consumer.get_watermark_offsets(
                confluent_kafka.TopicPartition(topic, p), timeout=10
            )
            a = _resolve_bound(consumer, topic, p, start, low, high)
            b = _resolve_bound(consumer, topic, p, end, high, high)
            out[(topic, p)] = (max(a, low), min(max(b, low), high))
    return out


def _resolve_bound(
    consumer: Any, topic: str, partition: int, bound: tuple[str, int] | None, dflt: int, high: int
) -> int:
    if bound is None:
        return dflt
    kind, value = bound
    if kind == "offset":
        return value
    (tp,) = consumer.offsets_for_times(
        [confluent_kafka.TopicPartition(topic, partition, value)], timeout=10
    )
    return high if tp.offset < 0 else int(tp.offset)


def _recorded_dict(m: Record, codec: TrajectoryCodec, stats: RecordStats) -> dict[str, Any]:
    value = m.value or b""
    d: dict[str, Any] = {
        "topic": m.topic,
        "partition": m.partition,
        "offset": m.offset,
        "timestamp_ms": m.timestamp_ms,
        "key": m.key,
        "headers": m.header_dict(),
        "trajectory": None,
        "raw": None,
        "error": None,
    }
    try:
        if m.header_error is not None:
            raise RecordDecodeError("bad_header", f"headers unreadable: {m.header_error}")
        d["trajectory"] = to_avro_dict(codec.decode(value))
    except Exception as e:  # recorded as it came, with the reason: nothing stops a recording
        reason = e.reason if isinstance(e, RecordDecodeError) else "internal"
        detail = e.detail if isinstance(e, RecordDecodeError) else f"{type(e).__name__}: {e}"
        stats.undecodable += 1
        d["raw"], d["error"] = value, f"{reason}: {detail[:2000]}"
    return d


# ---- read ---------------------------------------------------------------------------


def read_recording(path: Path) -> Iterator[Recorded]:
    """The records of a recording, in file order. A damaged file yields the records
    before the damage, then raises :class:`RecordingError` naming the block."""
    codec = TrajectoryCodec()
    for row in _rows(path):
        yield _from_dict(row, codec)


def _rows(path: Path) -> Iterator[dict[str, Any]]:
    """The plain Avro values of a recording, block by block (see :func:`read_recording`)."""
    try:
        f = path.open("rb")
    except OSError as e:
        raise RecordingError(f"cannot open recording {path}: {e.strerror}") from None
    with f:
        blocks = read_blocks(f, recording_schema())
        index = 0
        while True:
            at = f.tell()
            try:
                rows = next(blocks)
            except StopIteration:
                return
            except NotAContainerError as e:
                raise RecordingError(f"{path} is not an rlstream recording: {e}") from None
            except ContainerError as e:
                raise RecordingError(
                    f"{path}: block {index} (from byte {at}) is damaged or truncated: {e}"
                ) from None
            yield from rows
            index += 1


def _from_dict(row: dict[str, Any], codec: TrajectoryCodec) -> Recorded:
    t = row.get("trajectory")
    return Recorded(
        topic=row["topic"],
        partition=row["partition"],
        offset=row["offset"],
        timestamp_ms=row["timestamp_ms"],
        key=row.get("key"),
        headers=dict(row.get("headers") or {}),
        trajectory=codec.from_avro_dict(t) if t is not None else None,
        raw=row.get("raw"),
        error=row.get("error"),
    )


def read_namespace(kafka: KafkaConfig, namespace: str, envs: Sequence[str] = ()) -> list[Recorded]:
    """Every rollout record of a namespace, read as :func:`record` reads (no group)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "ns.avro"
        record(kafka, namespace, out, envs)
        return list(read_recording(out))


# ---- play ---------------------------------------------------------------------------


def play(
    path: Path,
    kafka: KafkaConfig,
    namespace: str,
    rate: float | None = None,
    original_timing: bool = False,
    progress: Callable[[int], None] | None = None,
    partitions: int = 4,
) -> int:
    """Publish a recording into ``namespace``'s rollout topics (the same env, key,
    headers and value bytes as recorded, undecodable ones included); returns the count."""
    from pipeline.kafka.topics import ensure_topics, namespace_topics
    from pipeline.kafka.transport import TrajectoryWriter

    records = list(read_recording(path))
    envs = sorted({r.env for r in records if r.env != "?"})
    ensure_topics(kafka, namespace_topics(namespace, envs, partitions))
    writer = TrajectoryWriter(kafka, namespace)
    codec = writer.codec
    start = time.monotonic()
    first_ts = min((r.timestamp_ms for r in records), default=0)
    for i, r in enumerate(records):
        if original_timing:
            wait = (r.timestamp_ms - first_ts) / 1000 - (time.monotonic() - start)
        elif rate:
            wait = i / rate - (time.monotonic() - start)
        else:
            wait = 0.0
        if wait > 0:
            time.sleep(wait)
        key = (r.key or b"").decode(errors="replace")
        if r.trajectory is not None:
            value = codec.encode(r.trajectory)
            headers = codec.headers(r.trajectory)
        else:
            value, headers = r.raw or b"", list(r.headers.items())
        writer.write_encoded(r.env, key, value, headers)
        if progress and i % 100 == 0:
            progress(i)
    writer.flush()
    return len(records)


# ---- a recording as the trainer's source -----------------------------------------------


def _owners(rows: list[dict[str, Any]], members: int, groups_per_batch: int) -> list[int]:
    """The member each recorded row goes to (see :class:`RecordingSource`): a group's
    rows go together, by the group's place in the order groups complete; rows outside a
    complete group (undecodable, or of a group that never completes) go round."""
    block = max(1, groups_per_batch // members)
    seen: dict[str, set[int]] = {}
    owner_of: dict[str, int] = {}
    for row in rows:
        t = row.get("trajectory")
        if t is None:
            continue
        gid = str(t.get("group_id"))
        indices = seen.setdefault(gid, set())
        indices.add(int(t.get("group_index", 0)))
        if gid not in owner_of and len(indices) >= int(t.get("group_size", 1)):
            owner_of[gid] = (len(owner_of) % groups_per_batch) // block % members
    return [
        owner_of.get(str((row.get("trajectory") or {}).get("group_id")), i % members)
        for i, row in enumerate(rows)
    ]


class RecordingSource:
    """The consumer calls the trainer makes, answered from a recording, in file order.
    Nothing is committed anywhere; ``exhausted`` is true once every record was served.
    Values are served as the single-object bytes of the recorded trajectory (the
    trainer decodes and checks them, as it does records from Kafka).

    For member ``member`` of a trainer group of ``members``, only its share is served:
    of each ``groups_per_batch`` groups in the order they complete, the member's block of
    ``groups_per_batch / members``, so that the group's global batches hold the groups
    one trainer alone would train, in the same row order."""

    def __init__(
        self, path: Path, member: int = 0, members: int = 1, groups_per_batch: int = 1
    ) -> None:
        codec = TrajectoryCodec()
        rows = list(_rows(path))
        if members > 1:
            owners = _owners(rows, members, groups_per_batch)
            rows = [row for row, owner in zip(rows, owners, strict=True) if owner == member]
        self._messages = [
            Record(
                topic=str(row["topic"]),
                partition=int(row["partition"]),
                offset=int(row["offset"]),
                timestamp_ms=int(row["timestamp_ms"]),
                key=row.get("key"),
                value=codec.encode_avro_dict(row["trajectory"])
                if row.get("trajectory") is not None
                else (row.get("raw") or b""),
                headers=tuple((row.get("headers") or {}).items()),
            )
            for row in rows
        ]
        self._pos = 0
        self._on_assign: Any = None
        self._assigned = False
        self._paused = False
        self._bounds: dict[tuple[str, int], tuple[int, int]] = {}
        for m in self._messages:
            tp, offset = (m.topic, m.partition), m.offset
            lo, hi = self._bounds.get(tp, (offset, offset + 1))
            self._bounds[tp] = (min(lo, offset), max(hi, offset + 1))

    def __len__(self) -> int:
        return len(self._messages)

    @property
    def exhausted(self) -> bool:
        return self._pos >= len(self._messages)

    def subscribe(self, patterns: Any, on_assign: Any = None, on_revoke: Any = None) -> None:
        self._on_assign = on_assign

    def assign(self, partitions: Any) -> None:
        self._assigned = True

    def assignment(self) -> list[confluent_kafka.TopicPartition]:
        return [confluent_kafka.TopicPartition(t, p) for t, p in sorted(self._bounds)]

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Record]:
        if not self._assigned and self._on_assign is not None:
            self._on_assign(self, self.assignment())
            self._assigned = True
        if self._paused:  # as Kafka's consumer: nothing, after the timeout
            time.sleep(max(0.0, min(timeout, 0.2)))
            return []
        batch = self._messages[self._pos : self._pos + num_messages]
        self._pos += len(batch)
        return batch

    def pause(self, partitions: Any) -> None:
        self._paused = True

    def resume(self, partitions: Any) -> None:
        self._paused = False

    def get_watermark_offsets(self, tp: Any, timeout: float = 0, cached: bool = False) -> Any:
        return self._bounds.get((tp.topic, tp.partition), (0, 0))

    def offsets_for_times(self, partitions: Any, timeout: float = 0) -> Any:
        return [confluent_kafka.TopicPartition(tp.topic, tp.partition, -1) for tp in partitions]

    def seek(self, tp: Any) -> None:
        raise RlstreamError("a recording is read in order; seeking is not supported")

    def close(self) -> None:
        return None
