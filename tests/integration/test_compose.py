"""docker-compose.yml's rlstream services, run as written outside a container.

There is no container engine here: each service's command line and environment are taken
from the file and run against the local broker, with the container's paths mapped onto
this machine (``/src``, mounted read-only there, is a read-only copy of the source here;
``/checkpoints`` a temporary folder; the brokers' addresses the local one's). The command's
own ``pip install`` runs into a fresh virtual environment whose dependencies come from the
test's own, so what is installed is rlstream from the read-only source. The Kafka services
(the apache/kafka image) are not run; tests/unit/test_config.py checks their settings.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import list_namespace_topics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def read_only_copy(dest: Path) -> Path:
    """The source as a container sees it: the project's files, nothing writable."""
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "runs", "build", ".rlstream", "lib", "*.egg-info", "__pycache__", ".*cache"
    )
    shutil.copytree(ROOT, dest, ignore=ignore)
    for path in [dest, *dest.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    return dest


def venv_on_ours(dest: Path) -> Path:
    """A virtual environment that sees this one's packages (a .pth file), so that the
    service's ``pip install`` only builds and installs rlstream."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(dest)], check=True)
    py = dest / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages")]
    (Path(site) / "rlstream-test-deps.pth").write_text("\n".join(ours) + "\n")
    return dest / "bin"


def service(
    compose: dict[str, Any], name: str, paths: dict[str, str], env: dict[str, str], home: Path
) -> tuple[list[str], dict[str, str]]:
    """The service's command and environment with the container's paths mapped; its
    Python is a virtual environment of its own in ``home`` (a container's own disk)."""
    bin_dir = venv_on_ours(home / "venv")
    env = {**env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "VIRTUAL_ENV": str(bin_dir.parent)}
    svc = compose["services"][name]
    command = svc["command"]
    args = shlex.split(command) if isinstance(command, str) else list(command)
    for container, here in paths.items():
        args = [re.sub(rf"^{re.escape(container)}(?=/|$)", here, a) for a in args]
    environment = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
    environment.update(env)  # the local broker and namespace in place of the file's
    return args, {**os.environ, **environment}


def test_every_rlstream_service_of_docker_compose_runs_as_written(
    bootstrap: str, namespace: str, schema_registry_url: str, tmp_path: Path
) -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    src = read_only_copy(tmp_path / "src")
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    paths = {"/src": str(src), "/checkpoints": str(checkpoints)}
    env = {
        "RLSTREAM_BOOTSTRAP": bootstrap,
        "RLSTREAM_NAMESPACE": namespace,
        "RLSTREAM_SCHEMA_REGISTRY": schema_registry_url,
    }
    assert compose["services"]["trainer"]["environment"]["RLSTREAM_SCHEMA_REGISTRY"].startswith(
        "http://registry:8080/"
    )
    assert compose["services"]["topics"]["environment"]["RLSTREAM_NAMESPACE"] == "compose"

    # the topics service: a one-shot that installs rlstream and creates the topics
    home = tmp_path / "topics"
    args, environ = service(compose, "topics", paths, env, home)
    done = subprocess.run(args, env=environ, cwd=home, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (home / "venv" / "bin" / "rlstream").exists()  # installed from the copy
    topics = list_namespace_topics(KafkaConfig(bootstrap=bootstrap), namespace)
    assert {f"{namespace}.rollouts.guess", f"{namespace}.rollouts.calc"} <= set(topics)
    assert not any(p.name.endswith(".egg-info") or p.name == "build" for p in src.iterdir())

    # the trainer and the two producer replicas, until the producers sample the weights
    # the trainer announced
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: dict[str, subprocess.Popen[str]] = {}
    names = ["trainer"] + [
        f"producer-{i}" for i in range(compose["services"]["producer"]["deploy"]["replicas"])
    ]
    try:
        for name in names:
            home = tmp_path / name
            args, environ = service(compose, name.split("-")[0], paths, env, home)
            out = (logs / f"{name}.log").open("w")
            procs[name] = subprocess.Popen(
                args, env=environ, cwd=home, stdout=out, stderr=subprocess.STDOUT, text=True
            )
        deadline = time.monotonic() + 420

        def versions() -> list[int]:
            found = []
            for name in names[1:]:
                seen = re.findall(r"version=(\d+)", (logs / f"{name}.log").read_text())
                found.append(int(seen[-1]) if seen else 0)
            return found

        while min(versions()) < 1:
            for name, proc in procs.items():
                assert proc.poll() is None, (
                    f"{name} exited {proc.returncode}: {(logs / f'{name}.log').read_text()[-3000:]}"
                )
            assert time.monotonic() < deadline, {n: versions() for n in names[1:]}
            time.sleep(1)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}: {(logs / f'{name}.log').read_text()[-3000:]}"
    assert any((checkpoints / "weights").iterdir())
    for name in names[1:]:
        assert "weights loaded version=" in (logs / f"{name}.log").read_text()
    # the producers registered the rollouts topic's subject: the trainer read (and
    # trained on) records in Confluent's wire format
    subject = f"{schema_registry_url}/subjects/{namespace}.rollouts.guess-value/versions/latest"
    with urllib.request.urlopen(subject, timeout=10) as answer:
        assert json.loads(answer.read())["id"] >= 1
