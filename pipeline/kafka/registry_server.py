"""A local schema registry (Apicurio Registry, no Docker) for development and tests.

``LocalRegistry(RegistryServerConfig(...)).start()`` fetches Apicurio Registry's Quarkus
distribution from Maven Central once (``io.apicurio:apicurio-registry-app``, classifier
``all``, a tar.gz, into ``infra/registry``), finds a Java 21 or newer, and runs it bound
to 127.0.0.1 only (its API on ``port``, health and metrics on ``port + 1``), storing
schemas in an H2 database file under the data directory, so ids survive a restart as
the records that carry them do. Clients use its Confluent-compatible API at
``http://127.0.0.1:PORT/apis/ccompat/v7``. Its state (pid, port, url) lives in
``<data_dir>/registry.json`` for ``stop`` and ``status`` from another process.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import BrokerError, InvalidConfigError, MissingToolError
from pipeline.kafka.java import find_java
from pipeline.kafka.local_service import (
    LocalService,
    alive,
    port_free,
    tail,
    terminate,
)

log = logging.getLogger(__name__)

APICURIO_VERSION = "3.3.3"
ARTIFACT = f"io.apicurio:apicurio-registry-app:{APICURIO_VERSION}:tar.gz:all"
STATE_FILE = "registry.json"
CCOMPAT_PATH = "/apis/ccompat/v7"
#: Apicurio 3 runs on Java 21 or newer.
JAVA_MINIMUM = 21


def registry_home() -> Path:
    """Where the distribution is unpacked: ``RLSTREAM_REGISTRY_HOME``, the source tree's
    ``infra/registry``, or (for an installed wheel) a cache folder."""
    if os.environ.get("RLSTREAM_REGISTRY_HOME"):
        return Path(os.environ["RLSTREAM_REGISTRY_HOME"])
    source = Path(__file__).resolve().parents[2] / "infra"
    if source.is_dir() and (source / "dev.sh").exists():
        return source / "registry"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "rlstream" / "registry"


def ensure_distribution(home: Path) -> Path:
    """The unpacked Apicurio distribution (its ``quarkus-run.jar``), fetched with Maven
    and unpacked only when missing."""
    dist = home / f"apicurio-registry-{APICURIO_VERSION}"
    if (dist / "quarkus-run.jar").exists():
        return dist
    mvn = shutil.which("mvn")
    if mvn is None:
        raise MissingToolError(
            f"Maven is needed once to fetch Apicurio Registry into {dist}: install it "
            "(Debian/Ubuntu: apt-get install maven)"
        )
    home.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s with Maven into %s", ARTIFACT, home)
    print(f"fetching Apicurio Registry {APICURIO_VERSION} (about 160 MB, once)", flush=True)
    proc = subprocess.run(
        [mvn, "-q", "-B", "dependency:copy", f"-Dartifact={ARTIFACT}", f"-DoutputDirectory={home}"],
        capture_output=True,
        text=True,
        check=False,
    )
    archive = home / f"apicurio-registry-app-{APICURIO_VERSION}-all.tar.gz"
    if proc.returncode != 0 or not archive.exists():
        last = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise BrokerError(f"Maven could not fetch {ARTIFACT}:\n{last}")
    partial = home / f".unpacking-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(partial, filter="data")
    shutil.rmtree(dist, ignore_errors=True)
    partial.rename(dist)
    archive.unlink()
    return dist


@dataclass(frozen=True)
class RegistryServerConfig:
    data_dir: Path = Path(".rlstream/registry")
    port: int = 8081
    start_timeout_s: float = 180.0
    stop_grace_s: float = 20.0
    heap: str = "512m"
    #: with a user, every request needs HTTP basic auth as that user (health excepted)
    user: str | None = None
    password: str | None = None

    def __post_init__(self) -> None:
        if (self.user is None) != (self.password is None):
            raise InvalidConfigError("a registry user needs a password, and a password a user")
        if self.user is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.user):
            raise InvalidConfigError(
                f"registry user {self.user!r}: letters, digits, _ and - only (at most 64)"
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{CCOMPAT_PATH}"


class LocalRegistry(LocalService):
    """Start, stop and inspect a local Apicurio Registry."""

    def __init__(self, config: RegistryServerConfig | None = None) -> None:
        self.config = config or RegistryServerConfig()
        super().__init__(self.config.data_dir, STATE_FILE)

    def pids(self, state: dict[str, Any]) -> list[int]:
        return [int(state["pid"])]

    @property
    def url(self) -> str:
        state = self.state()
        return str(state["url"]) if state else self.config.url

    def start(self) -> dict[str, Any]:
        """Start the registry (idempotent) and return when its API answers."""
        state = self.state()
        if state and alive(int(state["pid"])):
            self._wait_ready(state)
            return state
        for port in (self.config.port, self.config.port + 1):
            if not port_free("127.0.0.1", port):
                raise BrokerError(
                    f"port {port} is taken: start the registry on another with --port "
                    "(it takes PORT and PORT+1)"
                )
        java = find_java(JAVA_MINIMUM, "to run Apicurio Registry", look_further=True)
        dist = ensure_distribution(registry_home())
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._write_auth()
        log_path = self.data_dir / "registry.log"
        cmd = [
            java,
            f"-Xmx{self.config.heap}",
            "-Dquarkus.http.host=127.0.0.1",
            f"-Dquarkus.http.port={self.config.port}",
            # health and metrics (a build-time feature that cannot be switched off) on
            # the next port, also on loopback only
            "-Dquarkus.management.host=127.0.0.1",
            f"-Dquarkus.management.port={self.config.port + 1}",
            f"-Dapicurio.datasource.url=jdbc:h2:file:{self.data_dir / 'h2' / 'registry'}",
            "-Dapicurio.storage.snapshot.location=" + str(self.data_dir),
            "-Djava.io.tmpdir=" + str(self.data_dir),
            "-jar",
            str(dist / "quarkus-run.jar"),
        ]
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.data_dir,
                start_new_session=True,
            )
        state = {
            "pid": proc.pid,
            "port": self.config.port,
            "url": self.config.url,
            "data_dir": str(self.data_dir),
            "log": str(log_path),
        }
        self.state_path.write_text(json.dumps(state, indent=2))
        try:
            self._wait_ready(state)
        except BaseException:
            self.stop()
            raise
        return state

    def _write_auth(self) -> None:
        """Quarkus reads ``config/application.properties`` under its working directory:
        the credentials go there (owner-only), not on a command line ``ps`` shows."""
        config = self.data_dir / "config" / "application.properties"
        if self.config.user is None:
            config.unlink(missing_ok=True)
            return
        config.parent.mkdir(exist_ok=True)
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(
                "quarkus.http.auth.basic=true\n"
                "quarkus.security.users.embedded.enabled=true\n"
                "quarkus.security.users.embedded.plain-text=true\n"
                f"quarkus.security.users.embedded.users.{_escape(self.config.user)}="
                f"{_escape(str(self.config.password))}\n"
                "quarkus.http.auth.permission.all.paths=/*\n"
                "quarkus.http.auth.permission.all.policy=authenticated\n"
            )

    def _wait_ready(self, state: dict[str, Any]) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while not answers(str(state["url"])):
            if not alive(int(state["pid"])):
                raise BrokerError(
                    "Apicurio Registry exited during start; last lines of its log:\n"
                    + tail(Path(state["log"]))
                )
            if time.monotonic() > deadline:
                raise BrokerError(
                    f"Apicurio Registry did not answer within {self.config.start_timeout_s:.0f}s;"
                    f" see {state['log']}"
                )
            time.sleep(0.5)

    def stop(self) -> bool:
        """SIGTERM, then SIGKILL after the grace period; False when nothing ran."""
        state = self.state()
        if not state:
            return False
        stopped = terminate([int(state["pid"])], self.config.stop_grace_s, "registry")
        self.state_path.unlink(missing_ok=True)
        return bool(stopped)

    def status(self) -> dict[str, Any]:
        state = self.state()
        if not state:
            return {"running": False, "data_dir": str(self.data_dir)}
        running = alive(int(state["pid"]))
        return dict(state, running=running, answering=running and answers(str(state["url"])))


def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether a Confluent-compatible registry answers at ``url`` (asking for
    credentials counts)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/subjects", timeout=timeout) as r:
            return bool(r.status == 200)
    except urllib.error.HTTPError as e:
        return e.code == 401
    except OSError:
        return False


def _escape(text: str) -> str:
    """``text`` as a key or value of a Java properties file."""
    out = []
    for ch in text:
        if ch in "\\:=#! ":
            out.append("\\" + ch)
        elif ord(ch) < 32 or ord(ch) > 126:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)
