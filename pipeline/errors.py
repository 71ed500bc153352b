"""The one exception root of rlstream and the errors derived from it.

Per-message failures (a record that does not decode) are raised as
:class:`RecordDecodeError` and turned into data (dead-letter records, counters) by the
component that reads them. Per-process failures (no Java, a port in use, a broker that
will not start) are raised loudly with a message that says what to do.
"""

from __future__ import annotations

import math


class RlstreamError(Exception):
    """Root of every error rlstream raises on purpose."""


class InvalidConfigError(RlstreamError, ValueError):
    """A configuration value is out of range or inconsistent; the message names it."""


def check_range(
    name: str, value: float, low: float = -math.inf, high: float = math.inf, *, above: bool = False
) -> None:
    """Refuses a setting that is not a finite number in ``[low, high]`` (``(low, high]``
    with ``above``): a NaN learning rate or a negative timeout is an error, not a run."""
    ok = isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value > low if above else value >= low) and value <= high
    if not ok:
        op = ">" if above else ">="
        if high == math.inf:
            bound = f"{op} {low:g}"
        elif low == -math.inf:
            bound = f"<= {high:g}"
        else:
            bound = f"in {'(' if above else '['}{low:g}, {high:g}]"
        raise InvalidConfigError(f"{name} must be a finite number {bound}, got {value!r}")


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    """Refuses a setting that is not one of ``allowed``, naming them."""
    if value not in allowed:
        raise InvalidConfigError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")


class RecordDecodeError(RlstreamError, ValueError):
    """Bytes read from Kafka (or a recording) are not a valid rlstream record.

    ``reason`` is one of :data:`DECODE_REASONS`, stable and machine-readable (it becomes
    the dead-letter record's ``error_class`` and a counter label):

    - ``truncated``: the bytes end before the record does;
    - ``bad_marker``: neither Avro single-object encoding (``C3 01``) nor a schema
      registry's framing (``00``);
    - ``unknown_schema``: the writer schema's fingerprint is not known to this reader, or
      its registry id could not be resolved (no ``--schema-registry``, an id the registry
      lacks or holds no Avro schema under);
    - ``registry_unavailable``: the schema registry did not answer, or answered with an
      error, when asked for the record's schema id (:class:`RegistryUnavailableError`:
      the record may well be valid, and a trainer holds it until the registry answers);
    - ``bad_length``: a length or count prefix is negative or larger than the bytes left;
    - ``trailing_bytes``: bytes remain after the record;
    - ``tensor_mismatch``: a Tensor's dtype and shape disagree with its data length;
    - ``length_mismatch``: tokens, loss mask and log-probabilities disagree in length;
    - ``bad_span``: version spans or turns out of order, out of range or not covering
      every policy token;
    - ``non_finite``: a NaN or infinite reward or log-probability;
    - ``bad_enum``: an enum value (dtype, role, status) this reader does not know;
    - ``invalid``: any other violation of the record's contract;
    - ``bad_header``: Kafka headers that cannot be read (a name that is not UTF-8);
    - ``oversized``: a value larger than the reader's bound, refused undecoded;
    - ``tokenizer``: written with another tokenizer than the reader's;
    - ``temperature``: its log-probabilities were taken at another softmax temperature
      than the trainer's (metadata ``rlstream.logprob_temperature``);
    - ``token_range``, ``bad_logprob``, ``reward_bound``, ``future_version``: the
      training contract (:mod:`pipeline.train.contract`);
    - ``duplicate``, ``env_mismatch``: a repeated or foreign member of a GRPO group;
    - ``internal``: reading the record raised something unforeseen (the message names
      it); the record is settled like any other refusal.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.detail = message


DECODE_REASONS = (
    "truncated",
    "bad_marker",
    "unknown_schema",
    "registry_unavailable",
    "bad_length",
    "trailing_bytes",
    "tensor_mismatch",
    "length_mismatch",
    "bad_span",
    "non_finite",
    "bad_enum",
    "invalid",
    "bad_header",
    "oversized",
    "tokenizer",
    "temperature",
    "token_range",
    "bad_logprob",
    "reward_bound",
    "future_version",
    "duplicate",
    "env_mismatch",
    "internal",
)


class RegistryUnavailableError(RecordDecodeError):
    """The record's writer schema could not be asked for now: it says nothing about the
    record, which a reader that must not lose it reads again later."""

    def __init__(self, message: str) -> None:
        super().__init__("registry_unavailable", message)


class TrainingDivergedError(RlstreamError):
    """Training produced a non-finite loss, gradient or parameter too many times in a
    row; nothing non-finite was applied, saved or announced."""


class ProducerFailedError(RlstreamError):
    """Every one of a producer's recent episodes failed; it stopped rather than fill the
    rollout topics with failures."""


class InvalidTrajectoryError(RlstreamError, ValueError):
    """A trajectory built in Python breaks the record contract; it is never encoded."""


class KafkaClientError(RlstreamError):
    """A Kafka client call failed.

    ``code`` and ``name`` are librdkafka's error code and name, ``retriable`` says whether
    the same call may succeed if repeated, ``fatal`` whether the client is unusable.
    """

    def __init__(
        self,
        message: str,
        *,
        code: int | None = None,
        name: str = "",
        retriable: bool = False,
        fatal: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.name = name
        self.retriable = retriable
        self.fatal = fatal


class BrokerError(RlstreamError):
    """The local Apache Kafka broker could not be prepared, started or stopped."""


class MissingToolError(BrokerError):
    """A program the local broker needs (Java 17+, Maven) is not installed."""


class KafkaAuthError(KafkaClientError):
    """The cluster refused this client's credentials (SASL or TLS)."""
