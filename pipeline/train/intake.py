"""The trainer's intake: what each record read from a rollout topic is, before it may
wait for its group, and where the refused ones go.

:class:`RecordJudge` reads a record in this order, so that no byte is decoded in vain:
the headers (unreadable ones: ``bad_header``), the staleness filter on the headers'
``min_version`` (``max_version`` when stale tokens are masked; ``stale``, never
decoded), the size bound (``oversized``, never decoded), the decode (every
:class:`~pipeline.errors.RecordDecodeError` reason), the tokenizer, then the training
contract (:mod:`pipeline.train.contract`). Whatever exception a record provokes on the
way is a refusal (``internal`` when nobody foresaw it): no record can stop the trainer.

:class:`DeadLetters` sends each refused record, with its original key, headers and
bytes and the reason, to ``<ns>.deadletter``. A letter that would not fit in a Kafka
message keeps only a prefix of the value (its full size in the message and the
``rlstream.value_size`` header); one the client or the broker still refuses is logged
and counted. Either way the caller settles the record.

:class:`HeldRecords` keeps the records the judge could not decide because the schema
registry did not answer for their schema id (``registry_unavailable``): they may be
valid, so they are neither refused nor settled (the committed position stays below
them) and are judged again every few seconds until the registry answers.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from pipeline.errors import RecordDecodeError, RegistryUnavailableError
from pipeline.kafka.client import MAX_MESSAGE_BYTES
from pipeline.kafka.message import Record
from pipeline.kafka.topics import deadletter_topic
from pipeline.observe.telemetry import span
from pipeline.records.codec import AvroCodec, TrajectoryCodec, TrajectoryHeaders
from pipeline.records.registry import DOWN_S
from pipeline.records.trajectory import META_TEMPERATURE, Trajectory
from pipeline.train.contract import RecordContract

log = logging.getLogger(__name__)

#: a dead letter larger than this keeps only the first DEADLETTER_PREFIX bytes of the value
DEADLETTER_BYTES = MAX_MESSAGE_BYTES - 64 * 1024
DEADLETTER_PREFIX = 64 * 1024


class RecordJudge:
    """Decides one record: the trajectory to train, the error that refuses it, or the
    reason (``stale``) to drop it unread."""

    def __init__(
        self,
        contract: RecordContract,
        tokenizer_id: str,
        max_record_bytes: int,
        temperature: float = 1.0,
        whole: bool = False,
    ) -> None:
        self.contract = contract
        #: stale only when every token is (``stale_tokens: mask``): the filter reads the
        #: newest version instead of the oldest
        self.whole = whole
        self.tokenizer_id = tokenizer_id
        self.temperature = temperature  # the trainer's: log-probabilities taken at it
        self.max_record_bytes = max_record_bytes
        self.codec = TrajectoryCodec()

    def __call__(
        self, m: Record, stale: Callable[[int], bool], newest_version: int | None
    ) -> Trajectory | RecordDecodeError | str:
        """``m`` a record read from Kafka; ``stale(version)`` the staleness filter (on the
        record's oldest version, or its newest with ``whole``);
        ``newest_version`` the newest policy version announced (None: no bound)."""
        try:
            return self._judge(m, stale, newest_version)
        except Exception as e:  # whatever a record provokes, it is a refusal, never a crash
            return RecordDecodeError("internal", f"{type(e).__name__}: {str(e)[:500]}")

    def _judge(
        self, m: Record, stale: Callable[[int], bool], newest_version: int | None
    ) -> Trajectory | RecordDecodeError | str:
        if m.header_error is not None:  # e.g. a header name that is not UTF-8
            return RecordDecodeError("bad_header", f"headers unreadable: {m.header_error}")
        h = TrajectoryHeaders.parse(list(m.headers))
        v = h.max_version if self.whole else h.min_version
        if v is not None and v >= 0 and stale(v):
            return "stale"
        value = m.value or b""
        if len(value) > self.max_record_bytes:
            return RecordDecodeError(
                "oversized",
                f"{len(value)} bytes, more than max_record_bytes {self.max_record_bytes}",
            )
        try:
            with span("decode", "kafka"):
                t = self.codec.decode(value)
        except RecordDecodeError as e:
            return e
        if t.tokenizer_id != self.tokenizer_id:
            return RecordDecodeError(
                "tokenizer", f"{t.tokenizer_id[:80]} is not {self.tokenizer_id}"
            )
        sampled_at = t.metadata.get(META_TEMPERATURE)
        if sampled_at is not None and not _same_temperature(sampled_at, self.temperature):
            return RecordDecodeError(
                "temperature",
                f"its log-probabilities were taken at temperature {sampled_at[:40]!r}, "
                f"this trainer takes them at {self.temperature:g} (grpo.temperature)",
            )
        violation = self.contract.violation(t, newest_version)
        if violation is not None:
            return RecordDecodeError(*violation)
        return t


def _same_temperature(text: str, temperature: float) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isclose(value, temperature, rel_tol=1e-6)  # False for NaN


class DeadLetters:
    """Sends refused records to ``<ns>.deadletter`` through ``producer`` (None: only
    counted, as when training from a recording, whose ledger says it all)."""

    def __init__(self, producer: Any, namespace: str, component: str) -> None:
        self.producer = producer
        self.topic = deadletter_topic(namespace)
        self.component = component
        self.codec = AvroCodec("DeadLetter")
        self.count = 0  # records refused
        self.failures = 0  # letters the client refused or Kafka did not take

    def send(self, m: Record, e: RecordDecodeError) -> None:
        self.count += 1
        if self.producer is None:
            return
        headers = m.header_dict()  # none when unreadable: that is why it is here
        value, key = m.value, m.key
        message = e.detail[:2000]
        size = len(value or b"") + len(key or b"")
        size += sum(len(k) + len(v) for k, v in headers.items())
        if size > DEADLETTER_BYTES:
            headers = {k: v for k, v in headers.items() if len(k) + len(v) <= 1024}
            headers["rlstream.value_size"] = str(len(value or b"")).encode()
            message += f" (value cut to its first {DEADLETTER_PREFIX} of {len(value or b'')} bytes)"
            value, key = (value or b"")[:DEADLETTER_PREFIX], (key or b"")[:1024]
        record = {
            "source_topic": m.topic,
            "source_partition": m.partition,
            "source_offset": m.offset,
            "key": key,
            "headers": headers,
            "value": value,
            "error_class": e.reason,
            "error_message": message,
            "component": self.component,
            "time_ms": int(time.time() * 1000),
        }
        try:
            data = self.codec.encode(record, self.codec.framing_for(self.topic))
            while True:
                try:
                    self.producer.produce(self.topic, data, key, on_delivery=self._delivered)
                    break
                except BufferError:
                    self.producer.poll(0.1)
        except Exception as ex:  # e.g. a letter the client refuses: the record stays settled
            self.failures += 1
            log.warning(
                "dead letter not sent topic=%s partition=%d offset=%d reason=%s error=%s",
                m.topic,
                m.partition,
                m.offset,
                e.reason,
                str(ex)[:200],
            )
        self.producer.poll(0)

    def _delivered(self, err: Any, msg: Any) -> None:
        if err is not None:
            self.failures += 1
            log.warning("dead letter not delivered error=%s", err.str())


class HeldRecords:
    """Records waiting for the schema registry, in the order they were read. ``due()``
    hands them all back to be judged again once ``retry_s`` passed since they were last
    tried; ``full`` (``limit`` held) tells the reader to pause fetching until they drain.
    """

    def __init__(self, limit: int, retry_s: float = DOWN_S) -> None:
        self.limit = max(1, limit)
        self.retry_s = retry_s
        self._held: list[Record] = []
        self._next_try = 0.0
        self.total = 0  # records ever held (the same record held again counts again)
        self._since: float | None = None  # when the registry stopped answering

    def __len__(self) -> int:
        return len(self._held)

    @property
    def full(self) -> bool:
        return len(self._held) >= self.limit

    def hold(self, m: Record, e: RegistryUnavailableError) -> None:
        if self._since is None:
            self._since = time.monotonic()
            log.warning(
                "records held until the schema registry answers (judged again every "
                "%.0f s, reading paused at %d held): %s",
                self.retry_s,
                self.limit,
                e.detail[:300],
            )
        if not self._held:
            self._next_try = time.monotonic() + self.retry_s
        self._held.append(m)
        self.total += 1

    def due(self) -> list[Record]:
        """The held records, taken out, when it is time to judge them again (else none).
        Those the registry still cannot resolve are held again by the caller."""
        if not self._held or time.monotonic() < self._next_try:
            return []
        out, self._held = self._held, []
        return out

    def settled(self) -> None:
        """Called after judging what ``due()`` gave: logs the registry's return."""
        if not self._held and self._since is not None:
            log.info(
                "the schema registry answers again after %.0f s: held records judged",
                time.monotonic() - self._since,
            )
            self._since = None

    def drop_partitions(self, tps: set[tuple[str, int]]) -> int:
        """Let go of the held records of revoked partitions (read again by their new
        owner); returns how many."""
        keep = [m for m in self._held if (m.topic, m.partition) not in tps]
        dropped = len(self._held) - len(keep)
        self._held = keep
        return dropped

    def clear(self) -> int:
        dropped, self._held = len(self._held), []
        return dropped
