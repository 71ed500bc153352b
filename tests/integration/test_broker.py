"""The local broker itself: lifecycle through the CLI, a three-node cluster, and the
errors a user sees when something is missing or wrong."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import BrokerError, MissingToolError
from pipeline.kafka.broker import BrokerConfig, LocalBroker
from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import TopicSpec, describe_topics, ensure_topics
from tests.conftest import free_port_pair

pytestmark = pytest.mark.integration


def rlstream(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        check=False,
    )


def test_broker_lifecycle_through_the_cli(tmp_path: Path) -> None:
    port = str(free_port_pair())
    data = tmp_path / "data"
    where = ["--data-dir", str(data), "--port", port]
    assert rlstream("broker", "status", *where).returncode == 3
    # status and stop find the broker from any directory (the state dir notes it)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    noted = {"RLSTREAM_STATE_DIR": str(tmp_path / "state")}

    started = rlstream("broker", "start", *where, "--json", env=noted)
    assert started.returncode == 0, started.stderr
    info = json.loads(started.stdout.strip().splitlines()[-1])
    assert info["bootstrap"] == f"127.0.0.1:{port}" and not info["already_running"]
    pid = info["nodes"][0]["pid"]
    try:
        again = rlstream("broker", "start", *where, "--json")
        assert again.returncode == 0
        assert "already running" in again.stdout
        assert json.loads(again.stdout.strip().splitlines()[-1])["nodes"][0]["pid"] == pid

        status = rlstream("broker", "status", *where, "--json")
        assert status.returncode == 0
        assert json.loads(status.stdout.strip().splitlines()[-1])["answering"] is True
        assert (data / "node-0" / "server.log").stat().st_size > 0
        found = rlstream("broker", "status", "--json", env=noted, cwd=elsewhere)
        assert found.returncode == 0, found.stderr
        assert json.loads(found.stdout.strip().splitlines()[-1])["data_dir"] == str(data)
        assert f"the broker in {data}" in found.stderr
        # an unrelated state dir knows of no broker: not running, where it looked
        lost = rlstream(
            "broker", "status", env={"RLSTREAM_STATE_DIR": str(tmp_path)}, cwd=elsewhere
        )
        assert lost.returncode == 3 and ".rlstream/broker" in lost.stdout
    finally:
        stopped = rlstream("broker", "stop", env=noted, cwd=elsewhere)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    assert rlstream("broker", "status", *where).returncode == 3


def test_port_in_use_is_reported(tmp_path: Path) -> None:
    port = free_port_pair()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        result = rlstream("broker", "start", "--data-dir", str(tmp_path), "--port", str(port))
    assert result.returncode == 2
    assert f"port {port}" in result.stderr and "in use" in result.stderr


def test_broker_that_exits_during_start_shows_its_log(tmp_path: Path) -> None:
    broker = LocalBroker(
        BrokerConfig(
            data_dir=tmp_path,
            port=free_port_pair(),
            start_timeout_s=60,
            extra={"log.dirs": "/proc/forbidden/kafka"},
        )
    )
    with pytest.raises(BrokerError) as e:
        broker.start()
    assert "Kafka" in str(e.value)
    assert not broker.running()


def test_missing_java_says_what_to_install(tmp_path: Path) -> None:
    result = rlstream(
        "broker",
        "start",
        "--data-dir",
        str(tmp_path),
        "--port",
        str(free_port_pair()),
        env={"PATH": "/nonexistent", "JAVA_HOME": ""},
    )
    assert result.returncode == 2
    assert "Java 17" in result.stderr and "install" in result.stderr


def test_missing_maven_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.kafka.java import ensure_jars

    (tmp_path / "pom.xml").write_text("<project/>")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(MissingToolError, match="Maven"):
        ensure_jars(tmp_path)


@pytest.mark.slow
def test_three_node_cluster(tmp_path: Path) -> None:
    broker = LocalBroker(BrokerConfig(data_dir=tmp_path, nodes=3, port=free_port_pair(6)))
    try:
        state = broker.start()
        assert len(state["nodes"]) == 3
        kafka = KafkaConfig(bootstrap=broker.bootstrap)
        ensure_topics(kafka, [TopicSpec("replicated", 3)])
        (topic,) = describe_topics(kafka, ["replicated"])
        assert topic.replication == 3
        admin = kafka.admin()
        from confluent_kafka.admin import ConfigResource, ResourceType

        res = ConfigResource(ResourceType.BROKER, "1")
        config = admin.describe_configs([res])[res].result()
        assert config["min.insync.replicas"].value == "2"
    finally:
        broker.stop()
    assert not broker.running()
