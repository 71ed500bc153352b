"""What a run ran on: versions of rlstream and the libraries it trains and streams with,
the source's commit, Kafka's, and JAX's backend and devices (``environment.json``)."""

from __future__ import annotations

import json
import platform
import subprocess
from importlib import metadata, resources
from pathlib import Path
from typing import Any

#: the distributions whose versions a run records (and ``rlstream --version`` prints)
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "confluent-kafka", "fastavro")

FILE = "environment.json"


def versions() -> dict[str, str]:
    from pipeline import __version__

    out = {"rlstream": __version__}
    for dist in LIBRARIES:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "missing"
    try:
        import confluent_kafka

        out["librdkafka"] = confluent_kafka.libversion()[0]
    except ImportError:
        out["librdkafka"] = "missing"
    out["kafka (local broker)"] = kafka_version()
    from pipeline.records.avro_program import native_available

    # the C codec is compiled at install time where a C compiler is found
    out["record codec"] = "C" if native_available() else "Python"
    out["python"] = platform.python_version()
    return out


def kafka_version() -> str:
    """The Apache Kafka release the local broker runs (its Maven file's)."""
    try:
        pom = resources.files("pipeline.kafka_runtime").joinpath("pom.xml").read_text()
    except (OSError, ModuleNotFoundError):
        return "unknown"
    start = pom.find("<kafka.version>")
    end = pom.find("</kafka.version>")
    return pom[start + len("<kafka.version>") : end] if start >= 0 < end else "unknown"


def commit() -> str:
    """The git commit of rlstream's source (``+changes`` when it has uncommitted ones);
    ``unknown`` for an installed copy."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return "unknown"
    try:
        head = _git(root, "rev-parse", "--short=12", "HEAD")
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
    )
    return done.stdout.strip()


def backend() -> dict[str, Any]:
    """JAX's backend, its devices and the process count of the job."""
    import jax

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    return {
        "backend": jax.default_backend(),
        "devices": len(devices),
        "device_kinds": kinds,
        "processes": jax.process_count(),
    }


def environment() -> dict[str, Any]:
    return {"versions": versions(), "commit": commit(), "jax": backend()}


def write(run_dir: Path) -> Path:
    path = run_dir / FILE
    path.write_text(json.dumps(environment(), indent=2, sort_keys=True) + "\n")
    return path


def read(run_dir: Path) -> dict[str, Any] | None:
    try:
        value = json.loads((run_dir / FILE).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
