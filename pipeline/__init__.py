"""rlstream: asynchronous RL for LLM agents, with Apache Kafka between rollouts and training."""

from __future__ import annotations

from pipeline.errors import (
    BrokerError,
    InvalidConfigError,
    InvalidTrajectoryError,
    KafkaClientError,
    MissingToolError,
    RecordDecodeError,
    RlstreamError,
)
from pipeline.records.codec import AvroCodec, TrajectoryCodec, TrajectoryHeaders
from pipeline.records.schema_store import SchemaStore
from pipeline.records.trajectory import Timings, Trajectory, Turn, VersionSpan

__version__ = "0.1.0"

__all__ = [
    "AvroCodec",
    "BrokerError",
    "InvalidConfigError",
    "InvalidTrajectoryError",
    "KafkaClientError",
    "MissingToolError",
    "RecordDecodeError",
    "RlstreamError",
    "SchemaStore",
    "Timings",
    "Trajectory",
    "TrajectoryCodec",
    "TrajectoryHeaders",
    "Turn",
    "VersionSpan",
]
