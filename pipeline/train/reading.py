"""How a trainer reads its rollout partitions, mixed into
:class:`~pipeline.train.trainer.Trainer`: its Kafka consumer and the replacement of one
that failed for good; which partitions a member of a group owns; where each partition is
read from after a restart (the checkpoint's positions, past ranges certainly stale); the
pause while records wait for the schema registry; the commits of the checkpoint's
positions, with the progress producers' admission control reads from them; the lag.
"""

from __future__ import annotations

import logging
import re
import time
import zlib
from typing import Any

import confluent_kafka

from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import env_of
from pipeline.observe.telemetry import metric
from pipeline.records.ledger import Ledger
from pipeline.train.batching import GroupBuffer, GroupQueue
from pipeline.train.config import TrainerConfig
from pipeline.train.intake import HeldRecords
from pipeline.train.members import Members
from pipeline.train.positions import PositionTracker
from pipeline.train.stale import StaleRanges

log = logging.getLogger(__name__)


def fatal(err: Any) -> bool:
    """Whether a Kafka error means the client failed for good (it must be replaced)."""
    return isinstance(err, confluent_kafka.KafkaError) and (
        err.fatal() or err.code() == confluent_kafka.KafkaError._FATAL
    )


def _split(key: str) -> tuple[str, int]:
    topic, _, partition = key.rpartition(":")
    return topic, int(partition)


class PartitionReading:
    """The reading half of a trainer (the attributes below are the trainer's)."""

    cfg: TrainerConfig
    kafka: KafkaConfig | None
    members: Members
    consumer: Any
    source: Any
    tracker: PositionTracker
    buffer: GroupBuffer
    ready: GroupQueue
    held: HeldRecords
    reading_paused: bool
    ledger: Ledger
    drops: Any
    version: int
    version_times: dict[int, int]
    stale_ranges: StaleRanges
    consumer_failed: str | None
    consumer_renewals: int
    commit_failures: int
    _uncommitted: list[Any]
    _committing: list[Any] | None
    _pattern: str

    def _new_consumer(self) -> Any:
        # Static membership: a trainer restarted under the same instance id gets its
        # partitions back at once instead of waiting for the old session to time out.
        cfg, kafka = self.cfg, self.kafka
        assert kafka is not None  # (a trainer from a recording has no consumer to make)
        instance = cfg.instance if not self.members.many else f"{cfg.instance}.{cfg.member_index}"
        return kafka.consumer(
            f"{cfg.namespace}.trainer",
            **{
                "group.instance.id": f"{cfg.namespace}.trainer.{instance}",
                "session.timeout.ms": 30000,
                "on_commit": self._committed,
            },
        )

    def _renew_consumer(self) -> None:
        """Replace a consumer that failed for good (a fatal error: e.g. fenced by the
        group after a broker restart) by a new one that reads on from this trainer's own
        positions. What is read and not settled (groups waiting to complete or to be
        trained) is let go and read again, so nothing is lost and nothing trained twice:
        settled offsets stay settled, and the checkpoint holds the same positions."""
        log.warning(
            "the Kafka consumer failed for good (%s); a new one reads on from the "
            "trainer's positions",
            self.consumer_failed,
        )
        self._let_go(None)
        self.reading_paused = False
        if self._committing is not None and not self._uncommitted:
            self._uncommitted = self._committing  # its answer went with the old consumer
        self._committing = None
        try:
            self.consumer.close()
        except (confluent_kafka.KafkaException, RuntimeError) as e:
            log.info("the failed consumer did not close cleanly: %s", e)
        self.consumer = self._new_consumer()
        self.consumer_failed = None
        self.consumer_renewals += 1
        self._subscribe()

    def _subscribe(self) -> None:
        """A trainer alone subscribes to every rollout topic (static membership: a
        restart under the same instance id gets its partitions back at once). Members of
        a group take their partitions by member index instead (:meth:`_assign_mine`):
        the group restarts as a whole, so no partition ever moves between members, and
        none can be trained by two members from two views of its positions."""
        if self.members.many:
            self._assign_mine()
        else:
            self.consumer.subscribe(
                [self._pattern], on_assign=self._on_assign, on_revoke=self._on_revoke
            )

    def _assign_mine(self) -> None:
        """Assign this member the rollout partitions it owns and does not read yet:
        partition ``p`` of topic ``t`` belongs to member ``(crc32(t) + p) % members``,
        which never changes as topics and partitions are added."""
        try:
            topics = self.consumer.list_topics(timeout=10).topics
        except confluent_kafka.KafkaException as e:
            log.warning("rollout topics not listed (tried again shortly): %s", e)
            return
        rx = re.compile(self._pattern)
        current = {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
        new = [
            confluent_kafka.TopicPartition(t, p)
            for t, md in sorted(topics.items())
            if rx.match(t)
            for p in sorted(md.partitions)
            if self._owns(t, p) and (t, p) not in current
        ]
        if new:
            self._on_assign(self.consumer, new, incremental=True)

    def _owns(self, topic: str, partition: int) -> bool:
        return (zlib.crc32(topic.encode()) + partition) % self.members.count == self.members.index

    def _on_assign(self, consumer: Any, partitions: list[Any], incremental: bool = False) -> None:
        known = set(self.tracker.partitions())
        stale_until = self._stale_until([p for p in partitions if (p.topic, p.partition) in known])
        for tp in partitions:
            key = (tp.topic, tp.partition)
            if key in known:  # the checkpoint decides, whatever Kafka's committed offset says
                low = self.tracker.low(key)
                tp.offset = self._settle_stale(key, low, stale_until.get(key, low))
        if incremental:
            consumer.incremental_assign(partitions)
        else:
            consumer.assign(partitions)
        log.info("assigned partitions=%s", [(p.topic, p.partition, p.offset) for p in partitions])

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        released = self._let_go({(p.topic, p.partition) for p in partitions})
        log.info("revoked partitions=%d buffered_groups_released=%d", len(partitions), released)

    def _let_go(self, tps: set[tuple[str, int]] | None) -> int:
        """Let go of what was read from partitions ``tps`` (every partition when None)
        and not settled: groups waiting to complete or to be trained, held records. It
        is read again from the trainer's own positions, which stay: a trainer's
        partitions come back to it after a rebalance (its session timed out while the
        broker was away, say), and whatever Kafka's committed offset says meanwhile, the
        records it settled are skipped, not trained or dropped twice. Returns how many
        groups were let go."""
        if tps is None:
            dropped = self.buffer.clear() + self.ready.clear()
            self.held.clear()
        else:
            dropped = self.buffer.drop_partitions(tps) + self.ready.drop_partitions(tps)
            self.held.drop_partitions(tps)
        self.buffer.forget_done(dropped)  # they will complete again
        for tp in self.tracker.partitions() if tps is None else tps:
            self.tracker.let_go(tp)
        return len(dropped)

    def _stale_until(self, tps: list[Any]) -> dict[tuple[str, int], int]:
        """Per partition, the first offset that may not be certainly stale."""
        ts = self.version_times.get(self.version - self.cfg.max_staleness)
        if ts is None or self.source is not None:  # (a recording has no clock)
            return {}
        return self.stale_ranges.until(self.consumer, tps, ts)

    def _settle_stale(self, key: tuple[str, int], start: int, end: int) -> int:
        """Drop the unread, unsettled records of ``[start, end)`` as one range each;
        returns the offset to read from. Small ranges are left to the header filter."""
        if end <= start + 64:
            return start
        for a, b in self.tracker.unsettled(key, start, end):
            self.tracker.settle_range(key, a, b)
            self.ledger.drop_range(key[0], key[1], a, b, "stale_range")
            self.drops["stale_range"] += b - a
            metric("drop", b - a, reason="stale_range", env=env_of(key[0]) or "")
        log.info("skipped stale range topic=%s partition=%d from=%d to=%d", *key, start, end)
        return end

    def _skip_stale_ranges(self) -> None:
        """While running: seek past ranges that became certainly stale."""
        for key, end in self._stale_until(self.consumer.assignment()).items():
            start = self.tracker.next(key)
            if self._settle_stale(key, start, end) != start:
                try:
                    self.consumer.seek(confluent_kafka.TopicPartition(*key, end))
                except confluent_kafka.KafkaException as e:  # (revoked meanwhile, say)
                    log.info(
                        "no seek past the stale range (its records are skipped "
                        "one by one as they are read): %s",
                        e,
                    )

    def _lag(self) -> int:
        """Records of the assigned partitions not trained or dropped yet."""
        total = 0
        for tp in self.consumer.assignment():
            try:
                _, high = self.consumer.get_watermark_offsets(tp, cached=True)
            except confluent_kafka.KafkaException:
                continue
            if high >= 0:
                total += max(0, high - self._progress((tp.topic, tp.partition)))
        return total

    def _commit(self) -> None:
        """Commit the last checkpoint's offsets, asynchronously: a commit waits for the
        group coordinator, which a broker restart takes away for as long as the client
        needs to find it again (half a minute, seen), and the loop must not wait with it.
        :meth:`_committed` hears the answer. A failure loses nothing (the checkpoint holds
        the positions) but leaves producers' view of the lag behind, and producers held
        back by that view send nothing that would make the trainer checkpoint again: so a
        failed commit is retried every two seconds, not at the next checkpoint. One commit
        is in flight at a time; a newer checkpoint's offsets replace older ones waiting."""
        if self.source is not None:  # (a recording commits nowhere)
            self._uncommitted = []
        if not self._uncommitted or self._committing is not None:
            return
        offsets, self._uncommitted = self._uncommitted, []
        try:
            self.consumer.commit(offsets=offsets, asynchronous=True)
            self._committing = offsets
        except confluent_kafka.KafkaException as e:
            self._commit_failed(offsets, e.args[0] if e.args else e)

    def _finish_commits(self, timeout_s: float = 10.0) -> None:
        """At a stop, before the consumer closes: the last checkpoint's offsets committed
        (reading paused meanwhile), waiting at most ``timeout_s``: what is not committed
        by then is in the checkpoint, where a restart reads it."""
        if self.source is not None or not (self._uncommitted or self._committing):
            return
        try:
            self.consumer.pause(self.consumer.assignment())
        except confluent_kafka.KafkaException as e:
            log.info("reading not paused before the last commit: %s", e)
        deadline = time.monotonic() + timeout_s
        while (self._uncommitted or self._committing) and self.consumer_failed is None:
            if time.monotonic() > deadline:
                log.warning("the last offsets were not committed within %.0f s", timeout_s)
                return
            self._commit()
            self.consumer.poll(0.1)  # (answers the commit; reading is paused)

    def _committed(self, err: Any, partitions: list[Any]) -> None:
        """The consumer's answer to :meth:`_commit` (called from within ``consume``)."""
        offsets, self._committing = self._committing, None
        err = err or next((p.error for p in partitions or () if p.error is not None), None)
        if err is not None and offsets is not None:
            self._commit_failed(offsets, err)

    def _commit_failed(self, offsets: list[Any], err: Any) -> None:
        self.commit_failures += 1
        log.warning("offset commit failed (retried in 2 s): %s", err)
        if not self._uncommitted:  # (a newer checkpoint's offsets supersede these)
            self._uncommitted = offsets
        if fatal(err):
            self.consumer_failed = err.str()

    def _own_positions(self) -> dict[str, Any]:
        """The positions this member saves: in a group, only those of the partitions it
        owns (a partition's positions are its owner's alone)."""
        positions = self.tracker.to_json()
        if not self.members.many or self.source is not None:
            return positions
        return {k: v for k, v in positions.items() if self._owns(*_split(k))}

    def _progress(self, tp: tuple[str, int]) -> int:
        return self.tracker.next(tp) - self.tracker.pending_count(tp)

    def _hold_back(self) -> None:
        """Pause fetching while the held records are at their limit (the consumer stays
        in its group: it is still polled); resume once they drain."""
        full = self.held.full
        if full or self.reading_paused:
            parts = self.consumer.assignment()
            (self.consumer.pause if full else self.consumer.resume)(parts)
            self.reading_paused = full
