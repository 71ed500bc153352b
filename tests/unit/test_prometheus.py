"""The metrics endpoint over real HTTP, its output read by Prometheus's own parser."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.errors import RlstreamError
from pipeline.observe.prometheus import Exporter, Sample


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, "", ""


def test_samples_are_served_in_the_text_format() -> None:
    counts = {"ok": 3}

    def collect() -> list[Sample]:
        return [
            *(
                Sample("x_episodes_total", n, "counter", "episodes", {"status": s})
                for s, n in counts.items()
            ),
            Sample("x_lag_records", 12, help="lag"),
            Sample("x_loss", 0.125, help="loss\nwith a newline"),
            Sample("x_odd", 1, labels={"env": 'a "quoted" \\ name\nx'}),
            Sample("x_nan", float("nan")),
        ]

    exporter = Exporter(collect, 0, constant={"process": "producer-0"}).start()
    try:
        status, ctype, body = get(exporter.url)
        assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
        counts["env_error"] = 2  # read at scrape time
        _, _, body2 = get(exporter.url)
    finally:
        exporter.close()
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(body2)
        for s in f.samples
    }
    p = ("process", "producer-0")
    assert values[("x_episodes_total", (p, ("status", "ok")))] == 3
    assert values[("x_episodes_total", (p, ("status", "env_error")))] == 2
    assert values[("x_lag_records", (p,))] == 12
    assert values[("x_loss", (p,))] == 0.125
    assert values[("x_odd", (("env", 'a "quoted" \\ name\nx'), p))] == 1
    assert values[("x_nan", (p,))] != values[("x_nan", (p,))]  # NaN
    types = {f.name: f.type for f in text_string_to_metric_families(body)}
    assert types["x_episodes"] == "counter" and types["x_lag_records"] == "gauge"


def test_a_failing_collection_is_a_500_and_the_server_lives_on() -> None:
    calls = []

    def collect() -> list[Sample]:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("boom")
        return [Sample("x_up", 1)]

    exporter = Exporter(collect, 0).start()
    try:
        assert get(exporter.url)[0] == 500
        status, _, body = get(exporter.url)
        assert status == 200
        assert [
            (s.name, s.value) for f in text_string_to_metric_families(body) for s in f.samples
        ] == [("x_up", 1.0)]
    finally:
        exporter.close()


def test_a_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RlstreamError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            Exporter(lambda: [], port)
