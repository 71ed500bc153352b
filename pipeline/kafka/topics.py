"""Topic layout of a namespace, and idempotent topic creation.

Every experiment lives in a namespace ``<ns>``:

- ``<ns>.rollouts.<env>``: trajectories of one environment, keyed by GRPO group id;
- ``<ns>.weights``: weights announcements, compacted (the latest per key survives);
- ``<ns>.weights-data``: the announced checkpoints' files in chunks, for producers that
  cannot read the trainer's directory; compacted, so the newest full version stays;
- ``<ns>.deadletter``: records that failed to decode or validate, with the reason;
- ``<ns>.telemetry``: spans and metric samples of every process.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic
from tenacity import (
    before_sleep_log,
    retry,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from pipeline.errors import InvalidConfigError, KafkaClientError
from pipeline.kafka.client import MAX_MESSAGE_BYTES, KafkaConfig, wrap_error

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,100}$")
ROLLOUTS = ".rollouts."

DAY_MS = 24 * 3600 * 1000


TIMESTAMP_TYPE = "message.timestamp.type"
LOG_APPEND_TIME = "LogAppendTime"


def check_name(kind: str, name: str) -> str:
    if not _NAME.match(name):
        raise InvalidConfigError(
            f"{kind} {name!r} must be 1-100 characters of letters, digits, '_' or '-'"
        )
    return name


def rollout_topic(namespace: str, env: str) -> str:
    return f"{check_name('namespace', namespace)}{ROLLOUTS}{check_name('environment', env)}"


def weights_topic(namespace: str) -> str:
    return f"{check_name('namespace', namespace)}.weights"


def weights_data_topic(namespace: str) -> str:
    return f"{check_name('namespace', namespace)}.weights-data"


def deadletter_topic(namespace: str) -> str:
    return f"{check_name('namespace', namespace)}.deadletter"


def telemetry_topic(namespace: str) -> str:
    return f"{check_name('namespace', namespace)}.telemetry"


def producers_topic(namespace: str) -> str:
    """Producers' heartbeats (admission control across producers), compacted."""
    return f"{check_name('namespace', namespace)}.producers"


def env_of(topic: str) -> str | None:
    """The environment of a rollout topic name, or None for other topics."""
    _, sep, env = topic.partition(ROLLOUTS)
    return env if sep else None


@dataclass(frozen=True)
class TopicSpec:
    """A topic to create: name, partition count, replication factor (None: the broker's
    default) and topic-level configuration."""

    name: str
    partitions: int
    replication: int | None = None
    config: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TopicState:
    """What ``ensure_topics`` found or did for one topic."""

    name: str
    partitions: int
    replication: int
    action: str  # "created", "exists" or "grown"
    config: Mapping[str, str]


def namespace_topics(
    namespace: str,
    envs: Sequence[str],
    partitions: int,
    *,
    replication: int | None = None,
    overrides: Mapping[str, Mapping[str, str]] | None = None,
) -> list[TopicSpec]:
    """The topics of a namespace. ``overrides`` maps ``rollouts``, ``weights``,
    ``weights_data``, ``deadletter``, ``telemetry`` or ``producers`` to extra topic
    configuration."""
    if partitions < 1:
        raise InvalidConfigError(f"partitions must be at least 1, got {partitions}")
    if not envs:
        raise InvalidConfigError("give at least one environment (--envs a,b)")
    overrides = overrides or {}
    size = {"max.message.bytes": str(MAX_MESSAGE_BYTES)}
    # The broker stamps rollout records when it appends them, so that skipping a stale
    # range by time (the trainer) never trusts a producer's clock.
    rollouts = {
        **size,
        "cleanup.policy": "delete",
        "retention.ms": str(7 * DAY_MS),
        TIMESTAMP_TYPE: LOG_APPEND_TIME,
    }
    weights = {
        **size,
        "cleanup.policy": "compact",
        "segment.ms": str(600_000),
        "min.cleanable.dirty.ratio": "0.1",
        "min.compaction.lag.ms": "0",
    }
    # chunks are keyed by their place in a sending: a newer version's overwrite the older's,
    # and compaction (never of the last minute's, which a producer may be reading) frees them
    weights_data = {
        **weights,
        "segment.bytes": str(256 * 1024 * 1024),
        "min.compaction.lag.ms": "60000",
    }
    deadletter = {**size, "cleanup.policy": "delete", "retention.ms": str(14 * DAY_MS)}
    telemetry = {**size, "cleanup.policy": "delete", "retention.ms": str(3 * DAY_MS)}
    # the latest heartbeat of each producer; a stopped producer's tombstone goes soon
    producers = {
        **size,
        "cleanup.policy": "compact",
        "segment.ms": str(600_000),
        "min.cleanable.dirty.ratio": "0.1",
        "delete.retention.ms": str(600_000),
        TIMESTAMP_TYPE: LOG_APPEND_TIME,
    }

    def spec(name: str, parts: int, base: dict[str, str], kind: str) -> TopicSpec:
        return TopicSpec(name, parts, replication, {**base, **overrides.get(kind, {})})

    specs = [spec(rollout_topic(namespace, e), partitions, rollouts, "rollouts") for e in envs]
    specs.append(spec(weights_topic(namespace), 1, weights, "weights"))
    specs.append(spec(weights_data_topic(namespace), 1, weights_data, "weights_data"))
    specs.append(spec(deadletter_topic(namespace), 1, deadletter, "deadletter"))
    specs.append(spec(telemetry_topic(namespace), 1, telemetry, "telemetry"))
    specs.append(spec(producers_topic(namespace), 1, producers, "producers"))
    return specs


def _retriable(e: BaseException) -> bool:
    return isinstance(e, KafkaClientError) and e.retriable


_admin_retry = retry(
    retry=retry_if_exception(_retriable),
    stop=stop_after_attempt(5),
    wait=wait_exponential(multiplier=0.2, max=5),
    before_sleep=before_sleep_log(log, logging.WARNING),
    reraise=True,
)


@_admin_retry
def ensure_topics(
    kafka: KafkaConfig, specs: Iterable[TopicSpec], timeout: float = 30.0
) -> list[TopicState]:
    """Create the topics that are missing, grow partition counts that are too small,
    and leave the rest alone. Safe to call any number of times, from any process."""
    specs = list(specs)
    admin = kafka.admin()
    try:
        existing = admin.list_topics(timeout=timeout).topics
    except KafkaException as e:
        raise wrap_error(e, "listing topics") from e
    missing = [s for s in specs if s.name not in existing]
    actions: dict[str, str] = {s.name: "exists" for s in specs}
    if missing:
        new = [
            NewTopic(
                s.name,
                num_partitions=s.partitions,
                replication_factor=-1 if s.replication is None else s.replication,
                config=dict(s.config),
            )
            for s in missing
        ]
        for name, fut in admin.create_topics(new, operation_timeout=timeout).items():
            try:
                fut.result()
                actions[name] = "created"
            except KafkaException as e:
                if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise wrap_error(e, f"creating topic {name}") from e
    grow = [
        s for s in specs if s.name in existing and len(existing[s.name].partitions) < s.partitions
    ]
    if grow:
        futs = admin.create_partitions([NewPartitions(s.name, s.partitions) for s in grow])
        for name, fut in futs.items():
            try:
                fut.result()
                actions[name] = "grown"
            except KafkaException as e:
                raise wrap_error(e, f"adding partitions to {name}") from e
    _wait_visible(admin, [s.name for s in specs], timeout)
    return describe_topics(kafka, [s.name for s in specs], actions, timeout)


def _wait_visible(admin: AdminClient, names: Sequence[str], timeout: float) -> None:
    """Wait until every broker answering metadata knows the topics and their leaders
    (creation reaches the nodes of a cluster one after another)."""
    deadline = time.monotonic() + timeout
    while True:
        md = admin.list_topics(timeout=timeout).topics
        ready = all(
            n in md
            and md[n].error is None
            and md[n].partitions
            and all(p.leader >= 0 for p in md[n].partitions.values())
            for n in names
        )
        if ready or time.monotonic() > deadline:
            return
        time.sleep(0.2)


def describe_topics(
    kafka: KafkaConfig,
    names: Sequence[str],
    actions: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> list[TopicState]:
    """Partition count, replication and the non-default configuration of each topic."""
    from confluent_kafka.admin import ConfigResource, ResourceType

    admin = kafka.admin()
    md = admin.list_topics(timeout=timeout).topics
    resources = [ConfigResource(ResourceType.TOPIC, n) for n in names]
    configs: dict[str, dict[str, str]] = {}
    deadline = time.monotonic() + timeout
    for res in resources:
        while True:
            try:
                entries = admin.describe_configs([res], request_timeout=timeout)[res].result()
                break
            except KafkaException as e:
                # a node that has not heard of a new topic yet answers "unknown": ask again
                unknown = e.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART
                if not unknown or time.monotonic() > deadline:
                    raise wrap_error(e, f"describing topic {res.name}") from e
                time.sleep(0.2)
        configs[res.name] = {
            k: str(v.value) for k, v in entries.items() if not v.is_default and v.value is not None
        }
    out = []
    for n in names:
        parts = md[n].partitions if n in md else {}
        replication = len(next(iter(parts.values())).replicas) if parts else 0
        action = (actions or {}).get(n, "exists")
        out.append(TopicState(n, len(parts), replication, action, configs.get(n, {})))
    return out


def log_append_time(kafka: KafkaConfig, topic: str, timeout: float = 10.0) -> bool:
    """Whether the broker assigns the timestamps of ``topic``'s records
    (``message.timestamp.type=LogAppendTime``) rather than the producers."""
    state = describe_topics(kafka, [topic], timeout=timeout)[0]
    return state.config.get(TIMESTAMP_TYPE) == LOG_APPEND_TIME


def rollout_topics(kafka: KafkaConfig, namespace: str, timeout: float = 30.0) -> dict[str, str]:
    """The namespace's existing rollout topics, as ``{env: topic}``."""
    prefix = f"{check_name('namespace', namespace)}{ROLLOUTS}"
    md = kafka.admin().list_topics(timeout=timeout)
    return {t[len(prefix) :]: t for t in sorted(md.topics) if t.startswith(prefix)}


def list_namespace_topics(kafka: KafkaConfig, namespace: str, timeout: float = 30.0) -> list[str]:
    """Every existing topic of the namespace (names contain no dot, so ``<ns>.`` is
    the namespace's own prefix)."""
    prefix = f"{check_name('namespace', namespace)}."
    md = kafka.admin().list_topics(timeout=timeout)
    return sorted(t for t in md.topics if t.startswith(prefix))


def topic_records(
    kafka: KafkaConfig, names: Sequence[str], timeout: float = 10.0
) -> dict[str, int]:
    """Records each topic holds now (the sum over partitions of high minus low
    watermark; on a compacted topic an upper bound)."""
    from confluent_kafka import TopicPartition

    consumer = kafka.consumer(None)
    try:
        md = consumer.list_topics(timeout=timeout).topics
        out = {}
        for name in names:
            total = 0
            for p in md[name].partitions if name in md else {}:
                low, high = consumer.get_watermark_offsets(TopicPartition(name, p), timeout=timeout)
                total += max(0, high - low)
            out[name] = total
        return out
    finally:
        consumer.close()


def delete_topics(kafka: KafkaConfig, names: Sequence[str], timeout: float = 60.0) -> None:
    """Delete the topics and wait for the controller to accept each deletion."""
    if not names:
        return
    admin = kafka.admin()  # held until every answer came (it fails the futures on exit)
    futures = admin.delete_topics(list(names), operation_timeout=timeout)
    for name, future in futures.items():
        try:
            future.result()
        except KafkaException as e:
            raise wrap_error(e, f"deleting topic {name}") from e
