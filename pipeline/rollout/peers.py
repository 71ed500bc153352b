"""What admission control reads from Kafka: the trainer group's lag on the rollout topic
(:class:`LagMonitor`), and the producers' heartbeats on ``<ns>.producers``
(:class:`Heartbeats`): each producer's episodes in flight, its share of the budget and its
records acknowledged. The rule they feed is :mod:`pipeline.rollout.admission`. Every call
here blocks: the producer runs them off its event loop.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import confluent_kafka

from pipeline.errors import RecordDecodeError
from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import producers_topic
from pipeline.records.codec import AvroCodec

log = logging.getLogger(__name__)

#: a heartbeat's in-flight count above this is refused as nonsense
MAX_IN_FLIGHT = 1 << 20


class LagMonitor:
    """Reads the trainer group's lag on the rollout topic from Kafka offsets."""

    def __init__(self, kafka: KafkaConfig, topic: str, group: str) -> None:
        self.topic = topic
        self.consumer = kafka.consumer(group)

    def lag(self) -> int:
        md = self.consumer.list_topics(self.topic, timeout=10)
        parts = [
            confluent_kafka.TopicPartition(self.topic, p) for p in md.topics[self.topic].partitions
        ]
        committed = self.consumer.committed(parts, timeout=10)
        total = 0
        for tp in committed:
            low, high = self.consumer.get_watermark_offsets(tp, timeout=10)
            start = tp.offset if tp.offset >= 0 else low
            if tp.metadata and tp.metadata.isdigit():  # the trainer's read position
                start = max(start, int(tp.metadata))
            total += max(0, high - start)
        return total

    def close(self) -> None:
        self.consumer.close()


class Heartbeats:
    """This producer's heartbeats out, and its live peers' in (blocking calls: run them
    off the event loop)."""

    def __init__(
        self,
        kafka: KafkaConfig,
        namespace: str,
        producer_id: str,
        interval_s: float,
        timeout_s: float,
    ) -> None:
        self.topic = producers_topic(namespace)
        self.producer_id = producer_id
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.codec = AvroCodec("ProducerHeartbeat")
        self.producer = kafka.producer(**{"linger.ms": 0})
        self.consumer = kafka.consumer(
            None, **{"enable.partition.eof": True, "fetch.wait.max.ms": 50}
        )
        self.consumer.assign(
            [confluent_kafka.TopicPartition(self.topic, 0, confluent_kafka.OFFSET_BEGINNING)]
        )
        #: peer id -> (episodes in flight, share, records acknowledged, when received:
        #: monotonic seconds)
        self._peers: dict[str, tuple[int, int, int, float]] = {}
        #: each peer's records acknowledged as known when the lag was last polled
        self._sent_at_poll: dict[str, int] = {}
        self.refused = 0
        self._first_beat: float | None = None
        #: whether every heartbeat sent by a peer up to an interval after this producer's
        #: first one has been read (only then are the peers known)
        self.ready = False

    def beat(self, in_flight: int, sent: int, share: int) -> None:
        record = {
            "producer_id": self.producer_id,
            "in_flight": in_flight,
            "sent": sent,
            "budget_share": share,
            "interval_ms": int(self.interval_s * 1000),
            "sent_at_ms": int(time.time() * 1000),
        }
        self.producer.produce(
            self.topic,
            self.codec.encode(record, self.codec.framing_for(self.topic)),
            self.producer_id.encode(),
        )
        self.producer.poll(0)
        if self._first_beat is None:
            self._first_beat = time.monotonic()

    def read(self, timeout_s: float = 0.0) -> None:
        """Take in the heartbeats that arrived since the last read; until :attr:`ready`,
        read up to the end of the log (waiting up to ``timeout_s`` for it)."""
        started = time.monotonic()
        settled = self._first_beat is not None and started - self._first_beat >= self.interval_s
        deadline = started + (0.0 if self.ready else timeout_s)
        while True:
            msgs = self.consumer.consume(500, 0.05 if not self.ready else 0)
            at_end = False
            for m in msgs:
                err = m.error()
                if err is not None and err.code() == confluent_kafka.KafkaError._PARTITION_EOF:
                    at_end = True
                else:
                    self._take(m)
            if at_end:  # read to the end of the log
                self.ready = self.ready or settled
                return
            if not msgs and (self.ready or time.monotonic() >= deadline):
                self._give_up_waiting()
                return

    def _give_up_waiting(self) -> None:
        """Never wait for the peers longer than twice the timeout: a topic that cannot
        be read leaves this producer counting itself and the trainer's backlog only."""
        if self.ready or self._first_beat is None:
            return
        if time.monotonic() - self._first_beat > 2 * self.timeout_s:
            log.warning(
                "heartbeats on %s not readable: admitting on the trainer's backlog and this "
                "producer's episodes only",
                self.topic,
            )
            self.ready = True

    def _take(self, m: Any) -> None:
        if m.error() is not None:
            log.debug("heartbeat read error=%s", m.error().str())
            return
        key = m.key()
        try:
            peer = key.decode("utf-8") if key else ""
        except UnicodeDecodeError:
            peer = ""
        if not peer or peer == self.producer_id:
            return
        if m.value() is None:  # a tombstone: the peer stopped
            self._peers.pop(peer, None)
            return
        kind, ts = m.timestamp()
        age_s = time.time() - ts / 1000 if kind != confluent_kafka.TIMESTAMP_NOT_AVAILABLE else 0
        if age_s > max(self.timeout_s, 60.0):  # an old heartbeat from the log (a start)
            return
        try:
            hb = self.codec.decode(m.value())
            in_flight, share, sent = int(hb["in_flight"]), int(hb["budget_share"]), int(hb["sent"])
            if hb["producer_id"] != peer or not 0 <= in_flight <= MAX_IN_FLIGHT or sent < 0:
                raise RecordDecodeError("bad_heartbeat", f"{hb}"[:200])
        except (RecordDecodeError, KeyError, TypeError, ValueError) as e:
            self.refused += 1
            log.warning("heartbeat of %r refused: %s", peer[:100], str(e)[:200])
            return
        self._peers[peer] = (in_flight, share, sent, time.monotonic())

    def live(self) -> dict[str, int]:
        """The peers heard from within ``timeout_s``, and their episodes in flight."""
        now = time.monotonic()
        for peer, (*_, seen) in list(self._peers.items()):
            if now - seen > self.timeout_s:
                log.info("producer %s silent for %.1fs: no longer counted", peer, now - seen)
                del self._peers[peer]
                self._sent_at_poll.pop(peer, None)
        return {peer: n for peer, (n, *_) in self._peers.items()}

    def shares(self) -> dict[str, int]:
        """The live peers' budget shares (as they last said)."""
        return {peer: share for peer, (_, share, *_) in self._peers.items()}

    def mark_poll(self) -> None:
        """The lag is about to be polled: what the peers have written so far (as last
        heard) is in it."""
        self._sent_at_poll = {peer: sent for peer, (_, _, sent, _) in self._peers.items()}

    def unpolled(self) -> int:
        """Records the live peers wrote since the last :meth:`mark_poll` (a peer first
        heard of since then counts whole: a little high for one poll, never low)."""
        return sum(
            max(0, sent - self._sent_at_poll.get(peer, 0))
            for peer, (_, _, sent, _) in self._peers.items()
        )

    def leave(self) -> None:
        """Say this producer stopped (a tombstone), so the others stop counting it now."""
        try:
            self.producer.produce(self.topic, None, self.producer_id.encode())
            self.producer.flush(5)
        finally:
            self.consumer.close()
