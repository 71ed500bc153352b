"""A local Apache Kafka (KRaft mode, no ZooKeeper, no Docker) for development and tests.

``LocalBroker(BrokerConfig(...)).start()`` resolves the Kafka jars with Maven once
(``infra/kafka/pom.xml`` into ``infra/kafka/lib``), formats storage on first start, runs
one node (combined broker and controller) or a small cluster of ``nodes`` on 127.0.0.1
with ``java``, and returns when a metadata request sees every node. Its state (pids,
ports, bootstrap) lives in ``<data_dir>/broker.json`` so that ``stop`` and ``status``
work from another process.

Node ``i`` listens for clients on ``port + 2 i`` and for the controller quorum on
``port + 2 i + 1``.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import os
import re
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import BrokerError, InvalidConfigError
from pipeline.kafka.client import MAX_FETCH_BYTES, MAX_MESSAGE_BYTES
from pipeline.kafka.java import argfile_quote, ensure_jars, find_java, kafka_home
from pipeline.kafka.local_service import (
    LocalService,
    alive,
    port_free,
    reap,
    send_signal,
    stop_with_parent,
    tail,
    terminate,
)

log = logging.getLogger(__name__)

STATE_FILE = "broker.json"

#: Broker settings for this workload, shared by the local broker and docker-compose.yml.
WORKLOAD_SETTINGS: dict[str, str] = {
    "message.max.bytes": str(MAX_MESSAGE_BYTES),
    "replica.fetch.max.bytes": str(MAX_MESSAGE_BYTES),
    "replica.fetch.response.max.bytes": str(MAX_FETCH_BYTES),
    "fetch.max.bytes": str(MAX_FETCH_BYTES),
    "socket.request.max.bytes": str(MAX_FETCH_BYTES + 1024 * 1024),
    "auto.create.topics.enable": "false",
    "group.initial.rebalance.delay.ms": "0",
    "num.partitions": "1",
    "offsets.topic.num.partitions": "8",
    "log.cleaner.backoff.ms": "1000",
    "log.cleaner.min.compaction.lag.ms": "0",
    "log.cleaner.dedupe.buffer.size": str(32 * 1024 * 1024),
    "log.retention.check.interval.ms": "30000",
}


def replication_settings(nodes: int) -> dict[str, str]:
    """Replication for a cluster of ``nodes``: factor 3 and ``min.insync.replicas=2``
    from three nodes on, so an acknowledged record survives the loss of one node."""
    rf = 3 if nodes >= 3 else 1
    isr = 2 if nodes >= 3 else 1
    return {
        "default.replication.factor": str(rf),
        "min.insync.replicas": str(isr),
        "offsets.topic.replication.factor": str(rf),
        "transaction.state.log.replication.factor": str(rf),
        "transaction.state.log.min.isr": str(isr),
        "share.coordinator.state.topic.replication.factor": str(rf),
        "share.coordinator.state.topic.min.isr": str(isr),
    }


SCRAM_MECHANISM = "SCRAM-SHA-512"
_SCRAM_SAFE = re.compile(r"[A-Za-z0-9!#$%&()*+\-./:;<>?@^_{|}~]{1,128}")


@dataclass(frozen=True)
class BrokerConfig:
    """Where and how the local broker runs."""

    data_dir: Path = Path(".rlstream/broker")
    nodes: int = 1
    port: int = 9092
    host: str = "127.0.0.1"
    heap: str = "768m"
    start_timeout_s: float = 120.0
    stop_grace_s: float = 30.0
    kafka_home: Path | None = None
    extra: dict[str, str] = field(default_factory=dict)
    #: with a user, clients must authenticate with SASL/SCRAM-SHA-512 as this user (the
    #: credential is stored when the data directory is formatted)
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nodes > 9:
            raise InvalidConfigError(f"nodes must be between 1 and 9, got {self.nodes}")
        if not 1024 <= self.port <= 65535 - 2 * self.nodes:
            raise InvalidConfigError(f"port {self.port} is out of range")
        if (self.sasl_username is None) != (self.sasl_password is None):
            raise InvalidConfigError("SASL needs both a user name and a password")
        for what, value in (("user name", self.sasl_username), ("password", self.sasl_password)):
            if value is not None and not _SCRAM_SAFE.fullmatch(value):
                raise InvalidConfigError(
                    f"the SASL {what} must be 1-128 characters of letters, digits and "
                    "!#$%&()*+-./:;<>?@^_{|}~ (no quotes, commas, '=', brackets or spaces)"
                )

    @property
    def sasl(self) -> bool:
        return self.sasl_username is not None

    @property
    def security_protocol(self) -> str:
        return "SASL_PLAINTEXT" if self.sasl else "PLAINTEXT"

    def client_security(self) -> dict[str, str]:
        """librdkafka settings a client needs for this broker (the broker's own user)."""
        if not self.sasl:
            return {}
        return {
            "security.protocol": "sasl_plaintext",
            "sasl.mechanism": SCRAM_MECHANISM,
            "sasl.username": self.sasl_username or "",
            "sasl.password": self.sasl_password or "",
        }

    def client_port(self, i: int) -> int:
        return self.port + 2 * i

    def controller_port(self, i: int) -> int:
        return self.port + 2 * i + 1

    @property
    def bootstrap(self) -> str:
        return ",".join(f"{self.host}:{self.client_port(i)}" for i in range(self.nodes))


class LocalBroker(LocalService):
    """Start, stop and inspect a local Apache Kafka cluster of ``config.nodes`` nodes."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config or BrokerConfig()
        super().__init__(self.config.data_dir, STATE_FILE)
        self._stop_with_parent = False

    # ---- state ---------------------------------------------------------------------

    def pids(self, state: dict[str, Any]) -> list[int]:
        return [int(n["pid"]) for n in state["nodes"]]

    @property
    def bootstrap(self) -> str:
        state = self.state()
        return str(state["bootstrap"]) if state else self.config.bootstrap

    # ---- start -----------------------------------------------------------------------

    def start(self, stop_with_parent: bool = False) -> dict[str, Any]:
        """Start every node (formatting storage first if new) and wait until the cluster
        answers metadata requests with all nodes. Idempotent: a running broker is left
        as it is. With ``stop_with_parent`` (a broker that ``rlstream run`` started for
        itself) the nodes get SIGTERM when this process dies, even by SIGKILL; without
        it (``rlstream broker start``) they outlive the command that started them."""
        self._stop_with_parent = stop_with_parent
        state = self.state()
        if state and self.running():
            log.info("broker already running bootstrap=%s", state["bootstrap"])
            return state
        if state:
            self._kill_leftovers(state)
        cfg = self.config
        for i in range(cfg.nodes):
            for port in (cfg.client_port(i), cfg.controller_port(i)):
                if not port_free(cfg.host, port):
                    raise BrokerError(
                        f"port {port} on {cfg.host} is in use by another program: stop it, "
                        "or start the broker on other ports with --port"
                    )
        java = find_java()
        home = kafka_home(cfg.kafka_home)
        lib = ensure_jars(home)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cluster_id = self._cluster_id()
        nodes = []
        for i in range(cfg.nodes):
            node_dir = self.data_dir / f"node-{i}"
            props = node_dir / "server.properties"
            node_dir.mkdir(parents=True, exist_ok=True)
            props.touch(mode=0o600)  # it may hold the SASL password
            props.chmod(0o600)
            props.write_text(self._properties_text(i))
            if not (node_dir / "data" / "meta.properties").exists():
                self._format(java, lib, home, props, cluster_id, node_dir)
            nodes.append(self._launch(java, lib, home, props, node_dir, i))
        state = {
            "bootstrap": cfg.bootstrap,
            "security_protocol": cfg.security_protocol,
            **(
                {"sasl_mechanism": SCRAM_MECHANISM, "sasl_username": cfg.sasl_username}
                if cfg.sasl
                else {}
            ),
            "cluster_id": cluster_id,
            "nodes": nodes,
            "started_at": time.time(),
        }
        self.state_path.write_text(json.dumps(state, indent=2))
        try:
            self._wait_ready(state)
        except BaseException:
            self.stop()
            raise
        _remember(self.data_dir, add=True)
        log.info("broker started bootstrap=%s nodes=%d", cfg.bootstrap, cfg.nodes)
        return state

    def properties(self, i: int) -> dict[str, str]:
        """``server.properties`` of node ``i``."""
        cfg = self.config
        voters = ",".join(f"{j + 1}@{cfg.host}:{cfg.controller_port(j)}" for j in range(cfg.nodes))
        client = cfg.security_protocol  # the client listener's name and protocol
        props = {
            "process.roles": "broker,controller",
            "node.id": str(i + 1),
            "controller.quorum.voters": voters,
            "listeners": f"{client}://{cfg.host}:{cfg.client_port(i)},"
            f"CONTROLLER://{cfg.host}:{cfg.controller_port(i)}",
            "advertised.listeners": f"{client}://{cfg.host}:{cfg.client_port(i)}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": client,
            "listener.security.protocol.map": f"CONTROLLER:PLAINTEXT,{client}:{client}",
            "log.dirs": str(self.data_dir / f"node-{i}" / "data"),
        }
        if cfg.sasl:
            # brokers talk to each other over the same listener, as the same user
            props.update(
                {
                    "sasl.enabled.mechanisms": SCRAM_MECHANISM,
                    "sasl.mechanism.inter.broker.protocol": SCRAM_MECHANISM,
                    f"listener.name.sasl_plaintext.{SCRAM_MECHANISM.lower()}.sasl.jaas.config": (
                        "org.apache.kafka.common.security.scram.ScramLoginModule required "
                        f'username="{cfg.sasl_username}" password="{cfg.sasl_password}";'
                    ),
                }
            )
        props.update(WORKLOAD_SETTINGS)
        props.update(replication_settings(cfg.nodes))
        props.update(cfg.extra)
        return props

    def _properties_text(self, i: int) -> str:
        return "".join(f"{k}={v}\n" for k, v in self.properties(i).items())

    def _cluster_id(self) -> str:
        path = self.data_dir / "cluster_id"
        if path.exists():
            return path.read_text().strip()
        # Kafka's own ids never start with "-" (it would read as an option); draw again.
        cid = "-"
        while cid.startswith("-"):
            cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        path.write_text(cid)
        return cid

    def _java_cmd(self, java: str, lib: Path, home: Path, node_dir: Path) -> list[str]:
        return [
            java,
            f"-Xmx{self.config.heap}",
            "-Xms128m",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dkafka.logs.dir={node_dir}",
            f"-Dlog4j2.configurationFile={home / 'log4j2.properties'}",
            "-cp",
            str(lib / "*"),
        ]

    def _format(
        self, java: str, lib: Path, home: Path, props: Path, cluster_id: str, node_dir: Path
    ) -> None:
        cmd = [
            *self._java_cmd(java, lib, home, node_dir),
            "kafka.tools.StorageTool",
            "format",
            f"--cluster-id={cluster_id}",
            "--config",
            str(props),
            "--ignore-formatted",
        ]
        argfile = node_dir / "format.args"
        if self.config.sasl:
            # The credential goes to the JVM in an argument file (mode 0600, removed after):
            # on the command line, /proc/PID/cmdline would show the password to every user.
            c = self.config
            secret = (
                f"--add-scram={SCRAM_MECHANISM}=[name={c.sasl_username},password={c.sasl_password}]"
            )
            fd = os.open(argfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("\n".join(argfile_quote(a) for a in [*cmd[1:], secret]) + "\n")
            cmd = [cmd[0], f"@{argfile}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        finally:
            argfile.unlink(missing_ok=True)
        if proc.returncode != 0:
            raise BrokerError(
                f"formatting Kafka storage in {node_dir} failed:\n"
                + "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
            )

    def _launch(
        self, java: str, lib: Path, home: Path, props: Path, node_dir: Path, i: int
    ) -> dict[str, Any]:
        cmd = [*self._java_cmd(java, lib, home, node_dir), "kafka.Kafka", str(props)]
        out = open(node_dir / "stdout.log", "ab")
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=functools.partial(stop_with_parent, os.getpid())
            if self._stop_with_parent
            else None,
        )
        out.close()
        cfg = self.config
        return {
            "node_id": i + 1,
            "pid": proc.pid,
            "port": cfg.client_port(i),
            "controller_port": cfg.controller_port(i),
            "dir": str(node_dir),
        }

    def _wait_ready(self, state: dict[str, Any]) -> None:
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + self.config.start_timeout_s
        admin = AdminClient(
            {
                "bootstrap.servers": state["bootstrap"],
                "log_level": 0,
                **self.config.client_security(),
            }
        )
        want = len(state["nodes"])
        while True:
            for node in state["nodes"]:
                if not alive(node["pid"]):
                    node_dir = Path(node["dir"])
                    raise BrokerError(
                        f"Kafka node {node['node_id']} exited during start; last lines of "
                        f"its log:\n{tail(node_dir / 'server.log')}\n"
                        f"{tail(node_dir / 'stdout.log', 10)}"
                    )
            try:
                md = admin.list_topics(timeout=2)
                if len(md.brokers) >= want:
                    return
            except Exception:  # not up yet
                pass
            if time.monotonic() > deadline:
                raise BrokerError(
                    f"Kafka did not answer within {self.config.start_timeout_s:.0f}s; "
                    f"see {self.data_dir}/node-*/server.log"
                )
            time.sleep(0.5)

    # ---- stop and faults -------------------------------------------------------------

    def stop(self) -> bool:
        """Stop every node: SIGTERM, then SIGKILL after the grace period. Returns False
        when nothing was running."""
        state = self.state()
        if not state:
            return False
        pids = terminate([n["pid"] for n in state["nodes"]], self.config.stop_grace_s, "broker")
        self.state_path.unlink(missing_ok=True)
        _remember(self.data_dir, add=False)
        return bool(pids)

    def kill_node(self, node_id: int) -> None:
        """SIGKILL one node (fault injection); ``restart_node`` brings it back."""
        for node in (self.state() or {}).get("nodes", []):
            if node["node_id"] == node_id:
                send_signal(node["pid"], signal.SIGKILL)
                reap([node["pid"]])

    def restart_node(self, node_id: int) -> None:
        state = self.state()
        if not state:
            raise BrokerError("no local broker state to restart a node from")
        java, home = find_java(), kafka_home(self.config.kafka_home)
        lib = ensure_jars(home)
        for k, node in enumerate(state["nodes"]):
            if node["node_id"] == node_id and not alive(node["pid"]):
                node_dir = Path(node["dir"])
                state["nodes"][k] = self._launch(
                    java, lib, home, node_dir / "server.properties", node_dir, node_id - 1
                )
        self.state_path.write_text(json.dumps(state, indent=2))
        self._wait_ready(state)

    def _kill_leftovers(self, state: dict[str, Any]) -> None:
        for node in state["nodes"]:
            if alive(node["pid"]):
                send_signal(node["pid"], signal.SIGKILL)
        reap([n["pid"] for n in state["nodes"]])
        self.state_path.unlink(missing_ok=True)

    def status(self) -> dict[str, Any]:
        """Running nodes and whether the cluster answers."""
        state = self.state()
        if not state:
            return {"running": False, "data_dir": str(self.data_dir)}
        nodes = [dict(n, alive=alive(n["pid"])) for n in state["nodes"]]
        answering = False
        if any(n["alive"] for n in nodes):
            from confluent_kafka.admin import AdminClient

            try:
                admin = AdminClient(
                    {
                        "bootstrap.servers": state["bootstrap"],
                        "log_level": 0,
                        **self.config.client_security(),
                    }
                )
                answering = len(admin.list_topics(timeout=5).brokers) > 0
            except Exception:
                answering = False
        return {
            "running": all(n["alive"] for n in nodes),
            "answering": answering,
            "bootstrap": state["bootstrap"],
            "data_dir": str(self.data_dir),
            "nodes": nodes,
        }


def _registry() -> Path:
    """Where ``broker start`` notes the data directories of the brokers it started, so
    that ``status`` and ``stop`` find them from any directory (``RLSTREAM_STATE_DIR``)."""
    base = os.environ.get("RLSTREAM_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "rlstream"
    )
    return Path(base) / "brokers.json"


def _remember(data_dir: Path, add: bool) -> None:
    try:
        known = [d for d in _known() if d != str(data_dir)]
        path = _registry()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known + [str(data_dir)] * add, indent=2))
    except OSError as e:  # a read-only home: brokers are then found by --data-dir only
        log.warning("cannot note the broker in %s: %s", _registry(), e)


def _known() -> list[str]:
    try:
        value = json.loads(_registry().read_text())
    except (OSError, ValueError):
        return []
    return [d for d in value if isinstance(d, str)] if isinstance(value, list) else []


def running_brokers() -> list[LocalBroker]:
    """The local brokers ``broker start`` started that still run, from any directory."""
    found = []
    for d in _known():
        broker = LocalBroker(BrokerConfig(data_dir=Path(d)))
        if broker.running():
            found.append(broker)
    return found
