"""Checkpoints through the cluster, for producers that cannot read the trainer's folder.

``send_checkpoint`` cuts the files of a checkpoint into :data:`CHUNK_BYTES` pieces and sends
each as a :class:`WeightsChunk` record to the compacted ``<ns>.weights-data`` topic, keyed
by its place in the sending (``v/<i>``, or ``base/<i>`` for the base LoRA adapters apply
to): a newer version's chunks overwrite the older's, so compaction always keeps the newest
full version. It returns the files' digest (computed from the very bytes sent, so the
checkpoint is read once) and the ``transfer`` the announcement carries: where the chunks
lie.

``fetch_checkpoint`` reads that range back into a private folder. A sending is hostile
input like any record: every chunk must belong to the announced sending, come in order,
name a plain relative file (no ``..``, no absolute path, names in the digest's order) and
hash to its own SHA-256; the files must add up to the announced size, and the caller
compares their digest with the announced one before anything is loaded. Whatever fails is
a :class:`Refusal` with a reason; a sending whose chunks were overwritten by a
newer version while it was read is refused as ``incomplete`` (the newer one follows).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import confluent_kafka

from pipeline.errors import RecordDecodeError
from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import weights_data_topic
from pipeline.policy.checkpoint import ContentDigest, file_chunks
from pipeline.records.codec import shared_codec

log = logging.getLogger(__name__)

#: bytes of checkpoint per chunk record (records may be 16 MiB: see kafka.client)
CHUNK_BYTES = 4 * 1024 * 1024
#: bytes per fetch of chunks (a few chunks: see fetch_checkpoint)
FETCH_BYTES = 4 * CHUNK_BYTES
#: a sending or a fetch may take this long plus a second per :data:`SLOWEST_BYTES_PER_S` bytes
FETCH_BASE_S = 60.0
SLOWEST_BYTES_PER_S = 10 * 1024 * 1024


class Refusal(Exception):
    """A checkpoint (here: a sending) that is not loaded, for ``reason`` (a counter's
    name), with a detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail


def send_checkpoint(
    producer: confluent_kafka.Producer,
    namespace: str,
    path: Path,
    version: int,
    key: str = "v",
    timeout: float | None = None,
    stop: threading.Event | None = None,
) -> tuple[str, dict[str, Any]]:
    """Send the files of the checkpoint at ``path``; ``(digest, transfer)`` once the
    cluster has every chunk. TimeoutError or confluent_kafka.KafkaException when it
    does not within ``timeout`` (default: as long as a fetch of the same size may take),
    or when ``stop`` is set first (a trainer stopping while the cluster is gone)."""
    topic = weights_data_topic(namespace)
    codec = shared_codec("WeightsChunk")
    framing = codec.framing_for(topic)
    transfer_id = uuid.uuid4().hex
    digest = ContentDigest()
    offsets: dict[int, int] = {}
    errors: list[str] = []

    def delivered(index: int) -> Any:
        def report(err: Any, msg: Any) -> None:
            if err is not None:
                errors.append(str(err))
            else:
                offsets[index] = msg.offset()

        return report

    count = total = 0
    for rel, offset, size, data in file_chunks(path, size=CHUNK_BYTES):
        if offset == 0:
            digest.file(rel)
        digest.update(data)
        value = codec.encode(
            {
                "transfer_id": transfer_id,
                "policy_version": version,
                "index": count,
                "file": rel,
                "offset": offset,
                "file_size": size,
                "data": data,
                "sha256": hashlib.sha256(data).hexdigest(),
            },
            framing,
        )
        while True:
            try:
                producer.produce(
                    topic,
                    value,
                    f"{key}/{count}".encode(),
                    partition=0,
                    on_delivery=delivered(count),
                )
                break
            except BufferError:  # the client's queue is full: let it send
                if stop is not None and stop.is_set():
                    raise TimeoutError(f"stopped after {count} weights chunks") from None
                producer.poll(0.05)
        producer.poll(0)
        count += 1
        total += len(data)
    timeout = timeout if timeout is not None else _allowed_s(total)
    deadline = time.monotonic() + timeout
    while producer.flush(min(1.0, max(0.0, deadline - time.monotonic()))):
        if stop is not None and stop.is_set():
            raise TimeoutError(f"stopped before {count} weights chunks were acknowledged")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{count} weights chunks not all acknowledged in {timeout:.0f} s")
    if errors or len(offsets) != count:
        raise confluent_kafka.KafkaException(errors[0] if errors else "chunks not delivered")
    transfer = {
        "transfer_id": transfer_id,
        "topic": topic,
        "partition": 0,
        "first_offset": offsets[0],
        "last_offset": offsets[count - 1],
        "chunks": count,
        "bytes": total,
    }
    return digest.hexdigest(), transfer


def fetch_checkpoint(
    kafka: KafkaConfig,
    namespace: str,
    transfer: dict[str, Any],
    version: int,
    into: Path,
    timeout: float | None = None,
) -> str:
    """Read the sending ``transfer`` of checkpoint ``version`` into the folder ``into``
    (made here) and return the digest of what was written; :class:`Refusal`
    with the reason when the sending is not there whole and as announced."""
    chunks, size, first, last = _checked(namespace, transfer)
    free = shutil.disk_usage(into.parent).free
    if size > free:
        raise Refusal("too_large", f"{size} bytes announced, {free} free in {into.parent}")
    into.mkdir()
    deadline = time.monotonic() + (timeout if timeout is not None else _allowed_s(size))
    # fetches of a few chunks: buffers larger than the allocator keeps (64 MiB, the
    # consumers' default) are fresh memory for every fetch, and faulting it in made the
    # first fetch of a process four times slower
    consumer = kafka.consumer(
        None, **{"enable.partition.eof": True, "fetch.max.bytes": FETCH_BYTES}
    )
    consumer.assign([confluent_kafka.TopicPartition(transfer["topic"], 0, first)])
    writer = _Assembly(into, transfer["transfer_id"], version, chunks, size)
    try:
        while not writer.done:
            if time.monotonic() > deadline:
                raise Refusal("timeout", f"{writer.index} of {chunks} chunks read by the deadline")
            for msg in consumer.consume(16, 0.5):
                err = msg.error()
                if err is not None:
                    if err.code() == confluent_kafka.KafkaError._PARTITION_EOF:
                        raise Refusal(
                            "incomplete",
                            f"the topic ends before chunk {writer.index} of {chunks} "
                            "(removed by a newer version's, or never written)",
                        )
                    raise Refusal("kafka", err.str())
                if (msg.offset() or 0) > last:
                    raise Refusal(
                        "incomplete", f"chunk {writer.index} of {chunks} is not in its range"
                    )
                writer.take(msg.value() or b"")
                if writer.done:
                    break
        return writer.finish()
    finally:
        writer.close()
        consumer.close()


def _allowed_s(size: int) -> float:
    """How long sending or fetching ``size`` bytes may take."""
    return FETCH_BASE_S + size / SLOWEST_BYTES_PER_S


def _checked(namespace: str, transfer: Any) -> tuple[int, int, int, int]:
    """The sending's chunk count, size and offsets, if the announcement's ``transfer``
    names a sane range of this namespace's chunk topic."""
    try:
        topic, partition = transfer["topic"], int(transfer["partition"])
        chunks, size = int(transfer["chunks"]), int(transfer["bytes"])
        first, last = int(transfer["first_offset"]), int(transfer["last_offset"])
        str(transfer["transfer_id"])
    except (KeyError, TypeError, ValueError) as e:
        raise Refusal("transfer", f"malformed transfer: {e!r}") from None
    if topic != weights_data_topic(namespace) or partition != 0:
        raise Refusal(
            "transfer", f"chunks on {topic}[{partition}], not {weights_data_topic(namespace)}[0]"
        )
    if chunks < 1 or size < 0 or first < 0 or last - first + 1 < chunks:
        raise Refusal(
            "transfer", f"{chunks} chunks, {size} bytes at offsets {first}..{last} do not fit"
        )
    return chunks, size, first, last


class _Assembly:
    """The files of one sending written into ``into`` as its chunks arrive, in order.

    :meth:`take` decodes a chunk and checks where it goes at once (the caller's thread);
    hashing it, adding it to the digest and writing it happen in order on a thread of
    their own (both release the interpreter), so that the next chunks are fetched and
    decoded meanwhile. A failure there is raised by the next :meth:`take` or by
    :meth:`finish`."""

    #: chunks decoded and waiting to be hashed and written (at most this many in memory)
    AHEAD = 8

    def __init__(self, into: Path, transfer_id: str, version: int, chunks: int, size: int):
        self.into, self.transfer_id, self.version = into, transfer_id, version
        self.chunks, self.size = chunks, size
        self.codec = shared_codec("WeightsChunk")
        self.digest = ContentDigest()
        self.index = 0  # the next chunk expected
        self.written = 0
        self.file = ""
        self.file_size = 0
        self.at = 0  # bytes of the current file placed
        self.out: Any = None  # the file being written (by the writer thread), and its name
        self.writing = ""
        self._work: queue.Queue[tuple[Any, ...] | None] = queue.Queue(self.AHEAD)
        self._failed: Refusal | None = None
        self._writer = threading.Thread(target=self._write_all, name="weights-fetch", daemon=True)
        self._writer.start()

    @property
    def done(self) -> bool:
        return self.index == self.chunks

    def take(self, value: bytes) -> None:
        self._raise_failure()
        try:
            c = self.codec.decode(value)
        except RecordDecodeError as e:
            raise Refusal("undecodable", str(e)) from None
        if c["transfer_id"] != self.transfer_id:
            return  # another sending's chunk inside the range (two trainers, or a retry)
        if c["index"] != self.index:
            raise Refusal("incomplete", f"chunk {c['index']} came where chunk {self.index} belongs")
        if c["policy_version"] != self.version:
            raise Refusal(
                "version", f"chunk of version {c['policy_version']}, announced {self.version}"
            )
        data: bytes = c["data"]
        self._place(c["file"], c["offset"], c["file_size"], len(data))
        self.written += len(data)
        if self.written > self.size:
            raise Refusal("too_large", f"more than the announced {self.size} bytes")
        self._work.put(("data", self.index, data, c["sha256"]))
        self.at += len(data)
        self.index += 1
        if self.done:
            self._end_file()
            if self.written != self.size:
                raise Refusal("incomplete", f"{self.written} bytes of the announced {self.size}")

    def finish(self) -> str:
        """Wait for every chunk to be written; the digest of the files."""
        self._stop()
        self._raise_failure()
        return self.digest.hexdigest()

    def _place(self, rel: str, offset: int, file_size: int, n: int) -> None:
        """Open ``rel`` when the chunk begins a file; check it continues the current one
        otherwise."""
        if offset == 0:
            self._end_file()
            _check_file_name(rel)
            if self.file and rel <= self.file:
                raise Refusal("order", f"file {rel!r} after {self.file!r}")
            self._work.put(("open", rel))
            self.file, self.file_size, self.at = rel, file_size, 0
        elif rel != self.file or offset != self.at or file_size != self.file_size:
            raise Refusal(
                "order", f"bytes {offset}.. of {rel!r} where {self.file!r} is at {self.at}"
            )
        if self.at + n > self.file_size:
            raise Refusal("too_large", f"{rel!r} longer than its {self.file_size} bytes")

    def _end_file(self) -> None:
        if self.file and self.at != self.file_size:
            raise Refusal("incomplete", f"{self.file!r}: {self.at} of its {self.file_size} bytes")
        self._work.put(("close",))

    def _write_all(self) -> None:
        """The writer thread: each step in order, until the end or the first failure
        (after which steps are only taken off the queue)."""
        while (step := self._work.get()) is not None:
            if self._failed is not None:
                continue
            try:
                self._write(step)
            except Refusal as r:
                self._failed = r
            except Exception as e:  # the thread never dies with steps still coming
                self._failed = Refusal("file", repr(e))
        if self.out is not None:
            self.out.close()
            self.out = None

    def _write(self, step: tuple[Any, ...]) -> None:
        if step[0] == "open":
            rel = step[1]
            target = self.into / rel
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                self.out = target.open("xb")
            except OSError as e:
                raise Refusal("file", f"{rel!r}: {e}") from None
            self.writing = rel
            self.digest.file(rel)
        elif step[0] == "close":
            if self.out is not None:
                self.out.close()
                self.out = None
        else:
            _, index, data, sha256 = step
            if hashlib.sha256(data).hexdigest() != sha256:
                raise Refusal("chunk_digest", f"chunk {index} does not hash to its sha256")
            self.digest.update(data)
            try:
                self.out.write(data)
            except OSError as e:
                raise Refusal("file", f"{self.writing!r}: {e}") from None

    def _raise_failure(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _stop(self) -> None:
        if self._writer.is_alive():
            self._work.put(None)
            self._writer.join()

    def close(self) -> None:
        """Stop the writer thread (after what it holds) and close the open file."""
        self._stop()


def _check_file_name(rel: str) -> None:
    """A plain relative name: folders separated by ``/``, none of them empty, ``.`` or
    ``..``, no NUL."""
    if (
        not rel
        or len(rel) > 4096
        or "\0" in rel
        or "\\" in rel
        or any(p in ("", ".", "..") for p in rel.split("/"))
    ):
        raise Refusal("file", f"unsafe file name {rel[:200]!r}")
