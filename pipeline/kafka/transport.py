"""Trajectories in and out of Kafka: one record per trajectory, keyed by group id.

:class:`TrajectoryWriter` encodes and produces (delivery failures are counted and
raised at ``flush``, never ignored); :class:`TrajectoryReader` consumes batches and
decodes them, handing back records that fail to decode as data (:class:`Rejected`)
for the caller to dead-letter, instead of raising.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import confluent_kafka

from pipeline.errors import KafkaClientError, RecordDecodeError
from pipeline.kafka.client import KafkaConfig, kafka_errors, wrap_error
from pipeline.kafka.message import Record
from pipeline.kafka.topics import rollout_topic
from pipeline.observe.telemetry import span
from pipeline.records.codec import TrajectoryCodec
from pipeline.records.registry import SchemaRegistry, framing
from pipeline.records.schema_store import default_store
from pipeline.records.trajectory import Trajectory

log = logging.getLogger(__name__)


class TrajectoryWriter:
    """Produces trajectories to ``<ns>.rollouts.<env>`` with the codec's headers.

    With a schema registry (the default store's, set by ``--schema-registry``), the
    Trajectory schema is registered under each topic's ``<topic>-value`` subject on the
    topic's first use (:meth:`route`) and records carry the Confluent wire format.
    """

    def __init__(
        self,
        kafka: KafkaConfig,
        namespace: str,
        codec: TrajectoryCodec | None = None,
        registry: SchemaRegistry | None = None,
        **producer_overrides: Any,
    ) -> None:
        self.namespace = namespace
        self.codec = codec or TrajectoryCodec()
        self.registry = registry or default_store().registry
        conf = kafka.producer_config(**producer_overrides)
        self._producer = confluent_kafka.Producer(conf)
        #: how long librdkafka keeps trying a record before it reports it failed
        self.delivery_timeout_s = (
            float(conf.get("delivery.timeout.ms", conf.get("message.timeout.ms", 300_000))) / 1000
        )
        self._topics: dict[str, tuple[str, bytes | None]] = {}
        self._lock = threading.Lock()
        self.sent = 0
        self.delivered = 0
        self.failed = 0
        self.bytes = 0
        self.last_error: KafkaClientError | None = None

    def write(self, t: Trajectory, wait: bool = True) -> bool:
        """Encode and enqueue one trajectory. While the local queue is full: wait for
        room, or with ``wait=False`` write nothing and return False."""
        with span("produce", "kafka", env=t.env):
            value = self.codec.encode(t, self.route(t.env)[1])
            return self.write_encoded(t.env, t.group_id, value, self.codec.headers(t), wait)

    def route(self, env: str) -> tuple[str, bytes | None]:
        """The topic of ``env``'s trajectories and the framing records to it carry (None:
        single-object encoding). With a registry, the first call registers the schema
        and raises :class:`RegistryError` with the registry's reason if it refuses."""
        route = self._topics.get(env)
        if route is None:
            topic = rollout_topic(self.namespace, env)
            prefix = None
            if self.registry is not None:
                schema_id = self.registry.register(f"{topic}-value", self.codec.schema.text)
                prefix = framing(schema_id)
            route = self._topics[env] = (topic, prefix)
        return route

    def write_encoded(
        self,
        env: str,
        key: str,
        value: bytes,
        headers: Sequence[tuple[str, bytes]],
        wait: bool = True,
    ) -> bool:
        """Enqueue one encoded record; see :meth:`write` for ``wait`` and the result.
        Safe to call from several threads."""
        topic = self.route(env)[0]
        while True:
            try:
                self._producer.produce(
                    topic, value, key.encode(), headers=list(headers), on_delivery=self._on_delivery
                )
                break
            except BufferError:  # local queue full: serve callbacks, then retry
                if not wait:
                    self._producer.poll(0)
                    return False
                self._producer.poll(0.05)
            except confluent_kafka.KafkaException as e:
                raise wrap_error(e, f"producing to {topic}") from e
        with self._lock:
            self.sent += 1
            self.bytes += len(value)
        self._producer.poll(0)
        return True

    def _on_delivery(self, err: confluent_kafka.KafkaError | None, msg: Any) -> None:
        with self._lock:
            if err is None:
                self.delivered += 1
                return
            self.failed += 1
            self.last_error = wrap_error(confluent_kafka.KafkaException(err), "delivery")
        log.error("delivery failed topic=%s error=%s", msg.topic(), err.str())

    def settled(self) -> int:
        """Records the cluster has answered for, delivered or failed (delivery reports
        waiting are served first). A delivered record is in its partition's high
        watermark (``acks=all``); one written but not settled yet may not be."""
        self._producer.poll(0)
        with self._lock:
            return self.delivered + self.failed

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every record is acknowledged; raise if any failed or is still
        pending after ``timeout`` seconds (default: the delivery timeout and a little
        more, by when librdkafka has settled every record one way or the other: a
        cluster that comes back after a restart may need more than a minute before
        the client finds the partitions' leaders again, and nothing is given up
        sooner). Says every 10 s how many records it still waits for."""
        limit = self.delivery_timeout_s + 5 if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            remaining = self._producer.flush(max(0.0, min(10.0, deadline - time.monotonic())))
            if not remaining or time.monotonic() >= deadline:
                break
            log.info(
                "waiting for %d records to be acknowledged (at most %.0f s more)",
                remaining,
                deadline - time.monotonic(),
            )
        if remaining:
            raise KafkaClientError(
                f"{remaining} records still unacknowledged after {limit:.0f}s", retriable=True
            )
        if self.failed:
            raise KafkaClientError(
                f"{self.failed} of {self.sent} records were not delivered: {self.last_error}",
                retriable=False,
            )


@dataclass(frozen=True)
class Coordinates:
    """Where a record lies in Kafka."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int


@dataclass(frozen=True)
class Decoded:
    """A record that decoded into a trajectory."""

    where: Coordinates
    trajectory: Trajectory
    size: int


@dataclass(frozen=True)
class Rejected:
    """A record that did not decode: its coordinates, original bytes and the reason."""

    where: Coordinates
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    error: RecordDecodeError


class TrajectoryReader:
    """Consumes rollout topics as a member of ``group_id`` and decodes each record.
    Commits are the caller's (auto-commit is off)."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: Iterable[str],
        group_id: str | None,
        codec: TrajectoryCodec | None = None,
        **consumer_overrides: Any,
    ) -> None:
        self.codec = codec or TrajectoryCodec()
        self.consumer = kafka.consumer(group_id, **consumer_overrides)
        self.topics = list(topics)
        with kafka_errors("subscribing"):
            self.consumer.subscribe(self.topics)

    def poll_batch(self, max_records: int = 256, timeout: float = 0.5) -> list[Decoded | Rejected]:
        with kafka_errors("consuming"):
            msgs = self.consumer.consume(max_records, timeout)
        out: list[Decoded | Rejected] = []
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() == confluent_kafka.KafkaError._PARTITION_EOF:
                    continue
                raise wrap_error(confluent_kafka.KafkaException(err), "consuming")
            out.append(self.decode(m))
        return out

    def decode(self, m: Any) -> Decoded | Rejected:
        ts = m.timestamp()[1]
        where = Coordinates(m.topic(), m.partition(), m.offset(), ts)
        value = m.value()
        try:
            if value is None:
                raise RecordDecodeError("invalid", "record has no value")
            return Decoded(where, self.codec.decode(value), len(value))
        except RecordDecodeError as e:
            r = Record.of(m)
            return Rejected(where, r.key, value, list(r.header_dict().items()), e)

    def read(self, count: int, timeout: float = 60.0) -> list[Decoded | Rejected]:
        """Exactly ``count`` records, or :class:`KafkaClientError` after ``timeout``."""
        out: list[Decoded | Rejected] = []
        deadline = time.monotonic() + timeout
        while len(out) < count:
            if time.monotonic() > deadline:
                raise KafkaClientError(
                    f"read {len(out)} of {count} records in {timeout:.0f}s", retriable=True
                )
            out.extend(self.poll_batch(min(1024, count - len(out))))
        return out

    def close(self) -> None:
        self.consumer.close()


def read_ranges(
    consumer: Any,
    ranges: dict[tuple[str, int], tuple[int, int]],
    idle_timeout_s: float | None = None,
) -> Iterator[Record]:
    """The records of each partition's ``[start, end)``, partitions assigned directly
    (no group joined, nothing committed); a partition is unassigned once read to its end.
    With ``idle_timeout_s``, raises :class:`TimeoutError` after that long without a
    message while some range is unfinished."""
    todo = {tp: r for tp, r in ranges.items() if r[1] > r[0]}
    consumer.assign([confluent_kafka.TopicPartition(t, p, a) for (t, p), (a, _) in todo.items()])
    idle = 0.0
    while todo:
        msgs = consumer.consume(500, 1.0)
        idle = 0.0 if msgs else idle + 1.0
        if idle_timeout_s is not None and idle >= idle_timeout_s:
            raise TimeoutError(f"{len(todo)} partitions not read to their end")
        for m in msgs:
            if m.error() is not None:
                continue
            tp = (m.topic(), m.partition())
            offset = m.offset() or 0
            if tp not in todo or offset >= todo[tp][1]:
                continue
            if offset + 1 >= todo[tp][1]:
                del todo[tp]
                consumer.incremental_unassign([confluent_kafka.TopicPartition(*tp)])
            yield Record.of(m)
