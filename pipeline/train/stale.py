"""Ranges of a rollout partition that are certainly stale, found by the broker's time.

A record written before version ``v - max_staleness`` was announced carries only tokens
older than that version, so once the trainer is at ``v`` the whole range before that
moment can be settled at once and skipped by seek, without reading a byte of it. This is
sound only when the record times are the broker's own (``LogAppendTime``): a producer's
clock is not trusted, and on a ``CreateTime`` topic every record is filtered from its
own headers instead.
"""

from __future__ import annotations

import logging
from typing import Any

import confluent_kafka

from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import log_append_time

log = logging.getLogger(__name__)


class StaleRanges:
    """Per partition, where the certainly-stale records end."""

    def __init__(self, kafka: KafkaConfig | None) -> None:
        self.kafka = kafka
        self._timestamp_types: dict[str, bool] = {}

    def until(self, consumer: Any, tps: list[Any], since_ms: int) -> dict[tuple[str, int], int]:
        """Per partition of ``tps``, the first offset written at or after ``since_ms``
        (the end of the partition when none is): the records before it are stale."""
        tps = [p for p in tps if self.broker_timestamps(p.topic)]
        if not tps:
            return {}
        query = [confluent_kafka.TopicPartition(p.topic, p.partition, since_ms) for p in tps]
        out = {}
        try:
            for tp in consumer.offsets_for_times(query, timeout=5):
                end = tp.offset
                if end < 0:  # nothing at or after the time: all of it is stale
                    _, end = consumer.get_watermark_offsets(tp, timeout=5)
                out[(tp.topic, tp.partition)] = end
        except confluent_kafka.KafkaException as e:
            # (a broker away or just back: unknown partitions for a moment) a skip saves
            # reading only; the records are read and filtered one by one meanwhile
            log.info("stale ranges not looked up this time: %s", e)
        return out

    def broker_timestamps(self, topic: str) -> bool:
        """Whether ``topic``'s record times are the broker's (LogAppendTime): only then
        may a range be skipped by time."""
        known = self._timestamp_types.get(topic)
        if known is None:
            try:
                known = log_append_time(self.kafka, topic) if self.kafka else False
            except Exception as e:  # unknown for now: ask again at the next check
                log.warning("timestamp type of topic=%s unknown: %s", topic, str(e)[:200])
                return False
            self._timestamp_types[topic] = known
            if not known:
                log.warning(
                    "topic=%s has producer-set timestamps (CreateTime): stale ranges are "
                    "not skipped by time, each record is filtered from its headers "
                    "(recreate it with rlstream topics create to enable skipping)",
                    topic,
                )
        return known
