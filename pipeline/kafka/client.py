"""Thin wrappers over confluent-kafka with this workload's defaults.

:class:`KafkaConfig` is a frozen description of how to reach a cluster (bootstrap
servers, security, any extra librdkafka keys); ``producer()``, ``consumer()`` and
``admin()`` build clients from it. Defaults follow DESIGN: idempotent producers with
``acks=all`` and compression, manual commits, and message size limits raised to
:data:`MAX_MESSAGE_BYTES` everywhere (broker, topics, producer, consumer) so an 8 MB
trajectory passes. Kafka errors are re-raised as :class:`KafkaClientError` with their
code and whether they are retriable. Secrets are never logged or printed.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import confluent_kafka
from confluent_kafka import admin as kafka_admin

from pipeline.errors import InvalidConfigError, KafkaAuthError, KafkaClientError

log = logging.getLogger(__name__)
#: librdkafka's own log lines go here (connection chatter is INFO; warnings show).
rdkafka_log = logging.getLogger("librdkafka")
rdkafka_log.setLevel(logging.WARNING)

#: Largest record rlstream sends: 16 MiB, twice the 8 MB trajectory it must carry.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: Per-fetch limit of consumers (one fetch may hold several maximal records).
MAX_FETCH_BYTES = 4 * MAX_MESSAGE_BYTES

_SECRET_WORDS = ("password", "secret", "key.pem", "private", "token", "sasl.oauthbearer")


@dataclass(frozen=True)
class SecurityConfig:
    """How clients authenticate: ``protocol`` is PLAINTEXT, SSL, SASL_PLAINTEXT or
    SASL_SSL; SASL mechanism and credentials; TLS files."""

    protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ssl_ca_location: str | None = None
    ssl_certificate_location: str | None = None
    ssl_key_location: str | None = None

    def __post_init__(self) -> None:
        protocols = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
        if self.protocol not in protocols:
            raise InvalidConfigError(
                f"security protocol {self.protocol!r} is not one of {', '.join(protocols)}"
            )
        if self.protocol.startswith("SASL") and not (self.username and self.password):
            raise InvalidConfigError(f"{self.protocol} needs a username and a password")

    def describe(self) -> str:
        """Who this client is, for messages (never the password)."""
        if self.protocol.startswith("SASL"):
            return (
                f"user {self.username!r} ({self.sasl_mechanism or 'SCRAM-SHA-512'} over "
                f"{self.protocol})"
            )
        return f"a {self.protocol} client"

    def librdkafka(self) -> dict[str, str]:
        out = {"security.protocol": self.protocol.lower()}
        if self.protocol.startswith("SASL"):
            out["sasl.mechanism"] = self.sasl_mechanism or "SCRAM-SHA-512"
            out["sasl.username"] = self.username or ""
            out["sasl.password"] = self.password or ""
        for key, value in (
            ("ssl.ca.location", self.ssl_ca_location),
            ("ssl.certificate.location", self.ssl_certificate_location),
            ("ssl.key.location", self.ssl_key_location),
        ):
            if value:
                out[key] = value
        return out


@dataclass(frozen=True)
class KafkaConfig:
    """How to reach a Kafka cluster. ``extra`` passes any librdkafka key through
    unchanged (it wins over rlstream's defaults)."""

    bootstrap: str = "127.0.0.1:9092"
    security: SecurityConfig = field(default_factory=SecurityConfig)
    client_id: str = "rlstream"
    extra: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.bootstrap.strip():
            raise InvalidConfigError("bootstrap servers are empty: give host:port[,host:port]")

    @classmethod
    def from_env(cls, bootstrap: str | None = None, **overrides: Any) -> KafkaConfig:
        """Config from ``RLSTREAM_BOOTSTRAP`` and ``RLSTREAM_SECURITY_PROTOCOL``,
        ``RLSTREAM_SASL_MECHANISM``, ``RLSTREAM_SASL_USERNAME``, ``RLSTREAM_SASL_PASSWORD``,
        ``RLSTREAM_SSL_CA``, ``RLSTREAM_SSL_CERT``, ``RLSTREAM_SSL_KEY``."""
        env = os.environ
        security = SecurityConfig(
            protocol=env.get("RLSTREAM_SECURITY_PROTOCOL", "PLAINTEXT"),
            sasl_mechanism=env.get("RLSTREAM_SASL_MECHANISM"),
            username=env.get("RLSTREAM_SASL_USERNAME"),
            password=env.get("RLSTREAM_SASL_PASSWORD"),
            ssl_ca_location=env.get("RLSTREAM_SSL_CA"),
            ssl_certificate_location=env.get("RLSTREAM_SSL_CERT"),
            ssl_key_location=env.get("RLSTREAM_SSL_KEY"),
        )
        return cls(
            bootstrap=bootstrap or env.get("RLSTREAM_BOOTSTRAP", "127.0.0.1:9092"),
            security=security,
            **overrides,
        )

    def common(self) -> dict[str, Any]:
        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap,
            "client.id": self.client_id,
            "receive.message.max.bytes": MAX_FETCH_BYTES + 1024 * 1024,
            "logger": rdkafka_log,
        }
        conf.update(self.security.librdkafka())
        return conf

    def producer_config(self, **overrides: Any) -> dict[str, Any]:
        conf = self.common()
        conf.update(
            {
                "enable.idempotence": True,
                "acks": "all",
                "compression.type": "lz4",
                "linger.ms": 5,
                "batch.size": MAX_MESSAGE_BYTES,
                "message.max.bytes": MAX_MESSAGE_BYTES,
                "queue.buffering.max.kbytes": 512 * 1024,
                "delivery.timeout.ms": 300_000,
            }
        )
        conf.update(self.extra)
        conf.update(overrides)
        return conf

    def consumer_config(self, group_id: str | None, **overrides: Any) -> dict[str, Any]:
        conf = self.common()
        conf.update(
            {
                "group.id": group_id or f"{self.client_id}.reader",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",
                "fetch.max.bytes": MAX_FETCH_BYTES,
                "max.partition.fetch.bytes": MAX_MESSAGE_BYTES,
                "isolation.level": "read_committed",
            }
        )
        conf.update(self.extra)
        conf.update(overrides)
        return conf

    def admin_config(self) -> dict[str, Any]:
        conf = self.common()
        conf.update({k: v for k, v in self.extra.items() if not k.startswith(("fetch", "max."))})
        return conf

    def producer(self, **overrides: Any) -> confluent_kafka.Producer:
        return confluent_kafka.Producer(self.producer_config(**overrides))

    def consumer(self, group_id: str | None, **overrides: Any) -> confluent_kafka.Consumer:
        return confluent_kafka.Consumer(self.consumer_config(group_id, **overrides))

    def admin(self) -> kafka_admin.AdminClient:
        return kafka_admin.AdminClient(self.admin_config())


_AUTH_CODES = {
    confluent_kafka.KafkaError._AUTHENTICATION,
    confluent_kafka.KafkaError.SASL_AUTHENTICATION_FAILED,
    confluent_kafka.KafkaError._SSL,
}


#: every connection refused for this long: nothing listens at the bootstrap address
REFUSED_S = 5.0


def check_access(kafka: KafkaConfig, timeout_s: float = 60.0) -> None:
    """Fail at once, and say why, when the cluster refuses this client's credentials
    (:class:`KafkaAuthError`), or after ``timeout_s`` when no broker answers; return when
    the cluster answers a metadata request."""
    seen: list[confluent_kafka.KafkaError] = []
    logged: list[str] = []  # librdkafka's own log lines (connection failures come only there)
    handler = _Collect(logged)
    check_log = logging.getLogger("rlstream.kafka.check")
    check_log.propagate = False  # folded into the one error below instead
    check_log.addHandler(handler)
    conf = kafka.admin_config()
    conf["error_cb"] = seen.append
    conf["logger"] = check_log
    admin = kafka_admin.AdminClient(conf)
    try:
        _check(kafka, admin, seen, logged, timeout_s)
    finally:
        check_log.removeHandler(handler)


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__()
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def _check(
    kafka: KafkaConfig,
    admin: kafka_admin.AdminClient,
    seen: list[confluent_kafka.KafkaError],
    logged: list[str],
    timeout_s: float,
) -> None:
    start = time.monotonic()
    deadline = start + timeout_s
    who = kafka.security.describe()
    said = False
    while True:
        try:
            admin.list_topics(timeout=1)
            return
        except confluent_kafka.KafkaException as e:
            seen.append(e.args[0])
        admin.poll(0.2)  # serves error_cb: an authentication failure arrives there
        if not said:
            log.info("waiting for Kafka at %s (up to %.0f s) ...", kafka.bootstrap, timeout_s)
            said = True
        failed = [line for line in logged if " failed: " in line]
        if (
            len(failed) >= 3
            and all("Connection refused" in line for line in failed)
            and time.monotonic() - start > min(REFUSED_S, timeout_s)
        ):
            # nothing listens there (a cluster that is slow to answer still gets the
            # whole timeout: its connections are not refused)
            raise KafkaClientError(
                f"nothing accepts connections at {kafka.bootstrap} (every connection of "
                f"{who} refused for {min(REFUSED_S, timeout_s):.0f} s): start a local broker "
                "with `rlstream broker start`, or give the --bootstrap of a running cluster",
                retriable=True,
            )
        refused = [
            e for e in seen if isinstance(e, confluent_kafka.KafkaError) and e.code() in _AUTH_CODES
        ]
        if refused:
            raise KafkaAuthError(
                f"Kafka at {kafka.bootstrap} refused {who}: {refused[0].str()}. Check the "
                "user name and password (--sasl-username, RLSTREAM_SASL_PASSWORD), the "
                "mechanism (--sasl-mechanism) and --security-protocol"
            )
        closed = [line for line in logged if "closed by peer" in line]
        if len(closed) >= 3 and time.monotonic() - start > min(10.0, timeout_s):
            # the broker accepts the connection and hangs up at once: it speaks another
            # security protocol (SASL or TLS) than this client
            raise KafkaAuthError(
                f"Kafka at {kafka.bootstrap} closed every connection of {who} "
                f"({closed[-1].split(': ', 1)[-1]}): "
                "it expects another security protocol; give --security-protocol (and "
                "--sasl-mechanism, --sasl-username, RLSTREAM_SASL_PASSWORD or --ssl-ca)"
            )
        if time.monotonic() > deadline:
            last = (
                logged[-1].split(": ", 1)[-1]
                if logged
                else seen[-1].str()
                if seen and isinstance(seen[-1], confluent_kafka.KafkaError)
                else "no answer"
            )
            raise KafkaClientError(
                f"no Kafka broker at {kafka.bootstrap} answered within {timeout_s:.0f}s as "
                f"{who} ({last}); is it running, and does it expect this security protocol?",
                retriable=True,
            )


def redact(conf: Mapping[str, Any]) -> dict[str, Any]:
    """A client config that is safe to log: secret values replaced by ``***``."""
    return {k: "***" if any(w in k.lower() for w in _SECRET_WORDS) else v for k, v in conf.items()}


def wrap_error(e: BaseException, action: str) -> KafkaClientError:
    """A :class:`KafkaClientError` for a confluent-kafka exception or KafkaError."""
    err = e.args[0] if isinstance(e, confluent_kafka.KafkaException) and e.args else e
    if isinstance(err, confluent_kafka.KafkaError):
        return KafkaClientError(
            f"{action} failed: {err.name()} ({err.str()})",
            code=err.code(),
            name=err.name(),
            retriable=err.retriable(),
            fatal=err.fatal(),
        )
    return KafkaClientError(f"{action} failed: {e}")


@contextmanager
def kafka_errors(action: str) -> Iterator[None]:
    """Re-raise confluent-kafka errors inside the block as :class:`KafkaClientError`."""
    try:
        yield
    except confluent_kafka.KafkaException as e:
        raise wrap_error(e, action) from e


class WaitBudget:
    """Seconds a wind-down may spend waiting on the cluster, shared by all its waits (the
    last commits, a consumer leaving its group, a producer's flush): a cluster that
    stopped answering delays a stop once by the budget, not once per wait."""

    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + seconds

    def left(self, cap: float = math.inf) -> float:
        """What is left of the budget, at most ``cap``."""
        return max(0.0, min(cap, self._end - time.monotonic()))


class _Closable(Protocol):
    def close(self) -> Any: ...


def close_within(client: _Closable, seconds: float, what: str) -> bool:
    """``client.close()``, waiting at most ``seconds`` for it: a consumer leaving its
    group waits on the group's coordinator with no time limit of its own, so a stop
    would wait as long as the cluster is gone. Past ``seconds`` the close goes on in a
    daemon thread (which the process's exit ends) and False is returned, logged."""
    errors: list[BaseException] = []

    def close() -> None:
        try:
            client.close()
        except (confluent_kafka.KafkaException, RuntimeError) as e:
            errors.append(e)

    thread = threading.Thread(target=close, name=f"close {what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        log.warning(
            "the %s did not close within %.0f s (the cluster does not answer)", what, seconds
        )
        return False
    if errors:
        log.info("the %s did not close cleanly: %s", what, errors[0])
    return True
