"""Spans and metric samples of one process, batched to ``<ns>.telemetry`` off the hot path.

Code that does something worth seeing on the timeline wraps it in ``span(name, ...)``;
the span's start and end (Unix epoch nanoseconds, the host's clock: processes on one host
line up exactly, processes on different hosts as well as their clocks are synchronised)
go into an in-memory list, which costs an append. A background thread encodes what has
gathered as one ``Telemetry`` Avro record per interval and produces it to Kafka. The hot
path never blocks: past ``max_pending`` spans, new ones are counted as dropped instead.

Episodes are the most frequent source of spans (a reset, and per turn a policy turn and
an environment step): every episode records its own span, with its environment and
policy seconds as attributes, but the spans inside it are recorded for the episodes of
one decode slot in ``detail_every`` only (:meth:`Tracer.detailed`). The timeline keeps
those slots in full, the summary's shares come from every episode's attributes, and a
busy producer records about a third of the spans it would otherwise
(``rlstream bench telemetry``).

Until :func:`install` is called the process has a tracer that records nothing, so
instrumented code runs unchanged in tests and tools.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from pipeline.records.codec import AvroCodec

log = logging.getLogger(__name__)

SpanTuple = tuple[str, int, int, str, Mapping[str, Any]]


class Tracer:
    """Records spans and metrics of ``process``; with a Kafka ``producer`` and the
    ``topic`` to ship to (``<ns>.telemetry``: :func:`pipeline.observe.shipping.kafka_tracer`
    makes such a tracer) a flush thread (:meth:`start`) ships them, without one they are
    only kept for :meth:`take`. This module imports nothing of Kafka: every layer may
    instrument itself."""

    def __init__(
        self,
        process: str,
        producer: Any = None,
        topic: str = "",
        *,
        flush_s: float = 1.0,
        max_pending: int = 200_000,
        detail_every: int = 8,
    ) -> None:
        if detail_every < 1:
            raise ValueError(f"detail_every must be at least 1, not {detail_every}")
        self.process = process
        self.detail_every = detail_every
        self.max_pending = max_pending
        self.flush_s = flush_s
        self._spans: list[SpanTuple] = []
        self._metrics: list[tuple[str, int, float, Mapping[str, Any]]] = []
        self.dropped = 0
        self.sent = 0  # batches shipped
        self.spans_sent = 0
        self.flush_cpu_s = 0.0  # CPU time of the flushes (encoding, producing)
        self.codec = AvroCodec("Telemetry")
        self._producer: Any = producer
        self._topic = topic
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one flush at a time

    # -- recording (any thread) -----------------------------------------------------------

    def span(self, name: str, track: str = "", **attrs: Any) -> AbstractContextManager[None]:
        return _Span(self, name, track, attrs)

    def record(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        track: str = "",
        attrs: Mapping[str, Any] | None = None,
    ) -> None:
        if len(self._spans) >= self.max_pending:
            self.dropped += 1
            return
        self._spans.append((name, start_ns, end_ns, track, attrs or {}))

    def detailed(self, slot: int) -> bool:
        """Whether episodes of decode slot ``slot`` record the spans inside them."""
        return slot % self.detail_every == 0

    def metric(self, name: str, value: float, **labels: Any) -> None:
        if len(self._metrics) >= self.max_pending:
            self.dropped += 1
            return
        self._metrics.append((name, time.time_ns(), float(value), labels))

    # -- shipping (the flush thread) ------------------------------------------------------

    def start(self) -> Tracer:
        if self._producer is not None and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="telemetry", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.flush_s):
            try:
                self.flush()
            except Exception as e:  # telemetry must never take the process down
                log.warning("telemetry flush failed: %r", e)

    def take(self) -> dict[str, Any] | None:
        """What has gathered since the last call, as a ``Telemetry`` datum (or None)."""
        spans, self._spans = self._spans, []
        metrics, self._metrics = self._metrics, []
        if not spans and not metrics:
            return None
        return {
            "process": self.process,
            "host": _HOST,
            "pid": os.getpid(),
            # spans as tuples in the schema's field order (the encoder takes them as they are)
            "spans": [
                (
                    n,
                    s,
                    e,
                    tr,
                    {k: v if type(v) is str else str(v) for k, v in a.items()} if a else a,
                )
                for n, s, e, tr, a in spans
            ],
            "metrics": [
                {
                    "name": n,
                    "time_ns": t,
                    "value": v,
                    "labels": {k: str(x) for k, x in lab.items()},
                }
                for n, t, v, lab in metrics
            ],
        }

    def flush(self) -> None:
        with self._lock:
            cpu = time.thread_time()
            try:
                self._flush()
            finally:
                self.flush_cpu_s += time.thread_time() - cpu

    def _flush(self) -> None:
        datum = self.take()
        if datum is None or self._producer is None:
            return
        if self.dropped:
            datum["metrics"].append(
                {
                    "name": "telemetry_dropped",
                    "time_ns": time.time_ns(),
                    "value": float(self.dropped),
                    "labels": {},
                }
            )
        self._producer.produce(
            self._topic,
            self.codec.encode(datum, self.codec.framing_for(self._topic)),
            self.process.encode(),
        )
        self._producer.poll(0)
        self.sent += 1
        self.spans_sent += len(datum["spans"])

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the flush thread and ship what is left, waiting at most ``timeout_s`` in
        all (spans the cluster has not acknowledged by then are lost)."""
        end = time.monotonic() + timeout_s
        self._stop.set()
        if self._thread is not None:
            self._thread.join(max(0.0, end - time.monotonic()))
        try:
            self.flush()
        finally:
            if self._producer is not None:
                self._producer.flush(max(0.0, end - time.monotonic()))


class _Span(AbstractContextManager[None]):
    """``with tracer.span(...)``: a plain class, cheaper than a generator context manager
    on paths that open thousands of spans a second."""

    __slots__ = ("attrs", "name", "start", "tracer", "track")

    def __init__(self, tracer: Tracer, name: str, track: str, attrs: Mapping[str, Any]) -> None:
        self.tracer, self.name, self.track, self.attrs = tracer, name, track, attrs

    def __enter__(self) -> None:
        self.start = time.time_ns()

    def __exit__(self, *exc: object) -> None:
        self.tracer.record(self.name, self.start, time.time_ns(), self.track, self.attrs)


class NullTracer(Tracer):
    """Records nothing (the default until :func:`install`)."""

    def __init__(self) -> None:
        super().__init__("none")

    def span(self, name: str, track: str = "", **attrs: Any) -> AbstractContextManager[None]:
        return _NO_SPAN

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def detailed(self, slot: int) -> bool:
        return False

    def metric(self, *args: Any, **kwargs: Any) -> None:
        pass


_NO_SPAN = nullcontext()
_HOST = socket.gethostname()
_TRACER: Tracer = NullTracer()


def install(t: Tracer) -> Tracer:
    """Make ``t`` this process's tracer (and start shipping)."""
    global _TRACER
    _TRACER = t.start()
    return t


def tracer() -> Tracer:
    return _TRACER


def no_span(name: str, track: str = "", **attrs: Any) -> AbstractContextManager[None]:
    """What :func:`span` is where nothing is to be recorded (an episode not in detail)."""
    return _NO_SPAN


def span(name: str, track: str = "", **attrs: Any) -> AbstractContextManager[None]:
    """A span of this process's tracer: ``with span("env_step", track=f"slot-{i}"): ...``"""
    t = _TRACER
    return _NO_SPAN if type(t) is NullTracer else _Span(t, name, track, attrs)


def metric(name: str, value: float, **labels: Any) -> None:
    _TRACER.metric(name, value, **labels)
