"""A process's tracer that ships its spans and metrics to ``<ns>.telemetry``.

Kept apart from :mod:`pipeline.observe.telemetry`, which every layer imports to
instrument itself, so that it imports nothing of Kafka.
"""

from __future__ import annotations

from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import telemetry_topic
from pipeline.observe.telemetry import Tracer


def kafka_tracer(process: str, kafka: KafkaConfig, namespace: str) -> Tracer:
    """A :class:`Tracer` of ``process`` shipping to ``namespace``'s telemetry topic."""
    return Tracer(process, kafka.producer(), telemetry_topic(namespace))
