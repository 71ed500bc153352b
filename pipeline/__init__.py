"""rlstream: asynchronous RL for LLM agents, with Apache Kafka between rollouts and training."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipeline.errors import (
    BrokerError,
    InvalidConfigError,
    InvalidTrajectoryError,
    KafkaClientError,
    MissingToolError,
    RecordDecodeError,
    RlstreamError,
)

if TYPE_CHECKING:
    from pipeline.records.codec import AvroCodec, TrajectoryCodec, TrajectoryHeaders
    from pipeline.records.schema_store import SchemaStore
    from pipeline.records.trajectory import Timings, Trajectory, Turn, VersionSpan

__version__ = "0.1.0"

#: what ``from pipeline import X`` finds in the record modules, imported when first asked
#: for: they load numpy and ml_dtypes, and a process's first import of the package (the
#: command line's) must be quick enough to install its stop handler at once
_LAZY = {
    "AvroCodec": "pipeline.records.codec",
    "TrajectoryCodec": "pipeline.records.codec",
    "TrajectoryHeaders": "pipeline.records.codec",
    "SchemaStore": "pipeline.records.schema_store",
    "Timings": "pipeline.records.trajectory",
    "Trajectory": "pipeline.records.trajectory",
    "Turn": "pipeline.records.trajectory",
    "VersionSpan": "pipeline.records.trajectory",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")


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
