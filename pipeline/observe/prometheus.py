"""Prometheus metrics of a long-running process on ``http://HOST:PORT/metrics``.

Nothing is counted twice: a process hands the exporter a ``collect`` function that reads
the figures it keeps anyway (a producer's episode counts, lag, version; the trainer's step,
drops, staleness) at scrape time and returns :class:`Sample` s. prometheus_client does the
rest: a custom collector in a registry of its own turns them into metric families, and
its HTTP server (a daemon thread) renders the text exposition format, so a scrape never
touches the process's hot path. A collection that fails is a 500; the process lives on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from pipeline.errors import RlstreamError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    name: str
    value: float
    kind: str = "gauge"  # or "counter" (name ends in _total)
    help: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)


class _Figures:
    """A prometheus_client collector over ``collect()``: samples of one name become one
    family (a counter's ``_total`` is the family's, as the library writes it)."""

    def __init__(
        self, collect: Callable[[], Iterable[Sample]], constant: Mapping[str, str]
    ) -> None:
        self._collect, self._constant = collect, dict(constant)

    def collect(self) -> Iterator[Metric]:
        for attempt in range(3):  # a counter dict resized mid-copy: read again
            try:
                samples = list(self._collect())
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        families: dict[str, tuple[CounterMetricFamily | GaugeMetricFamily, list[str]]] = {}
        for s in samples:
            labels = {**self._constant, **s.labels}
            if s.name not in families:
                names = sorted(labels)
                kind = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
                families[s.name] = (kind(s.name, s.help, labels=names), names)
            family, names = families[s.name]
            family.add_metric([str(labels[k]) for k in names], float(s.value))
        for family, _ in families.values():
            yield family


class Exporter:
    """Serves ``collect()`` at ``/metrics`` from construction on (port 0: any free port,
    see :attr:`port`)."""

    def __init__(
        self,
        collect: Callable[[], Iterable[Sample]],
        port: int,
        host: str = "127.0.0.1",
        constant: Mapping[str, str] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Figures(collect, constant or {}))
        try:
            self.server, self._thread = start_http_server(port, host, self.registry)
        except OSError as e:
            raise RlstreamError(f"cannot serve metrics on {host}:{port}: {e.strerror}") from None
        self.host, self.port = host, int(self.server.server_address[1])

    def scrape(self) -> str:
        """What a scrape would get now."""
        return generate_latest(self.registry).decode()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def start(self) -> Exporter:
        return self  # (serving since construction)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
