"""Prometheus metrics of a long-running process on ``http://HOST:PORT/metrics``.

Nothing is counted twice: a process hands the exporter a ``collect`` function that reads
the figures it keeps anyway (a producer's episode counts, lag, version; the trainer's step,
drops, staleness) at scrape time and returns :class:`Sample` s, rendered in the Prometheus
text exposition format (version 0.0.4). The server is the standard library's threading
HTTP server on a daemon thread, so a scrape never touches the process's hot path.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pipeline.errors import RlstreamError

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Sample:
    name: str
    value: float
    kind: str = "gauge"  # or "counter" (name ends in _total)
    help: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if v != int(v) else str(int(v))


def render(samples: Iterable[Sample], constant: Mapping[str, str] | None = None) -> str:
    """The text exposition format: samples of one name together under their HELP/TYPE."""
    by_name: dict[str, list[Sample]] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    lines = []
    for name, group in by_name.items():
        first = group[0]
        lines.append(f"# HELP {name} {first.help.replace(chr(10), ' ')}")
        lines.append(f"# TYPE {name} {first.kind}")
        for s in group:
            labels = {**(constant or {}), **s.labels}
            body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            lines.append(
                f"{name}{{{body}}} {_number(s.value)}" if body else f"{name} {_number(s.value)}"
            )
    return "\n".join(lines) + "\n"


class Exporter:
    """Serves ``collect()`` at ``/metrics`` (port 0: any free port, see :attr:`port`)."""

    def __init__(
        self,
        collect: Callable[[], Iterable[Sample]],
        port: int,
        host: str = "127.0.0.1",
        constant: Mapping[str, str] | None = None,
    ) -> None:
        self.collect = collect
        self.constant = dict(constant or {})
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "metrics are at /metrics")
                    return
                try:
                    body = exporter.scrape().encode()
                except Exception as e:  # a scrape must not take the process down
                    log.warning("metrics collection failed: %r", e)
                    self.send_error(500, "metrics collection failed")
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # one line per scrape is noise

        try:
            self.server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise RlstreamError(f"cannot serve metrics on {host}:{port}: {e.strerror}") from None
        self.server.daemon_threads = True
        self.host, self.port = host, int(self.server.server_address[1])
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="metrics", daemon=True
        )

    def scrape(self) -> str:
        for attempt in range(3):  # a counter dict resized mid-copy: read again
            try:
                return render(self.collect(), self.constant)
            except RuntimeError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def start(self) -> Exporter:
        self._thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
