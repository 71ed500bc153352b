"""Shared fixtures. Integration tests run against a real Apache Kafka: the one named by
``RLSTREAM_BOOTSTRAP`` (``infra/dev.sh test`` starts it), or else one the test run
starts in a temporary folder and stops at the end."""

from __future__ import annotations

import importlib.util
import os
import random
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pipeline import compile_cache
from pipeline.kafka.client import KafkaConfig

if TYPE_CHECKING:
    from pipeline.records.registry import SchemaRegistry

# tests/verifiers_suite needs verifiers, whose classic API needs mcp<2 where this suite's
# MCP tests need mcp>=2.3: infra/dev.sh test runs it in an environment of its own (the
# test-verifiers extra) after this suite
collect_ignore = [] if importlib.util.find_spec("verifiers") else ["verifiers_suite"]

# One compilation cache for this test run and every rlstream process it starts (a fresh
# private directory: nothing compiled by another run is loaded).
os.environ.setdefault("RLSTREAM_COMPILE_CACHE", tempfile.mkdtemp(prefix="rlstream-jax-"))
# brokers the tests start are noted here, not among the user's own
os.environ.setdefault("RLSTREAM_STATE_DIR", tempfile.mkdtemp(prefix="rlstream-state-"))
compile_cache.enable()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that need llama.cpp's server run last: ``infra/dev.sh test`` builds it in the
    background while the others run."""
    items.sort(key=lambda item: item.get_closest_marker("llama_server") is not None)


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Before the first test that needs llama.cpp's server, and outside its timeout: wait
    for the background build."""
    if item.get_closest_marker("llama_server"):
        await_llama_server()
    yield


def await_llama_server(limit_s: float = 3600.0) -> None:
    """Wait until the build ``infra/dev.sh test`` started is done: the file named by
    ``RLSTREAM_LLAMA_SERVER_BUILD`` then holds its exit status and the binary's path,
    which becomes ``RLSTREAM_LLAMA_SERVER`` (or, if it failed,
    ``RLSTREAM_LLAMA_SERVER_FAILED`` says why)."""
    done = os.environ.get("RLSTREAM_LLAMA_SERVER_BUILD")
    if (
        not done
        or os.environ.get("RLSTREAM_LLAMA_SERVER")
        or os.environ.get("RLSTREAM_LLAMA_SERVER_FAILED")
    ):
        return
    path = Path(done)
    if not path.exists():
        print(f"\nwaiting for llama.cpp's server to build ({path})", file=sys.stderr)
    deadline = time.monotonic() + limit_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(2)
    lines = path.read_text().splitlines() if path.exists() else []
    if len(lines) >= 2 and lines[0] == "0":
        os.environ["RLSTREAM_LLAMA_SERVER"] = lines[1]
        return
    log = path.with_name("llama-server.log")
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    status = f"exit status {lines[0]}" if lines else f"not done in {limit_s:.0f} s"
    os.environ["RLSTREAM_LLAMA_SERVER_FAILED"] = f"its build failed ({status}): {log}\n{tail}"


def free_port_pair(count: int = 2) -> int:
    """A port p such that p ... p + count - 1 are free (client and controller of each
    node), below the kernel's ephemeral range so that no client connection takes them
    before the broker."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000, 2)
        if all(_free(p) for p in range(port, port + count)):
            return port
    raise RuntimeError("no free port pair")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="session")
def bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("RLSTREAM_BOOTSTRAP"):
        yield os.environ["RLSTREAM_BOOTSTRAP"]
        return
    from pipeline.kafka.broker import BrokerConfig, LocalBroker

    data_dir: Path = tmp_path_factory.mktemp("broker")
    broker = LocalBroker(BrokerConfig(data_dir=data_dir, port=free_port_pair()))
    broker.start()
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture
def kafka(bootstrap: str) -> KafkaConfig:
    return KafkaConfig(bootstrap=bootstrap)


@pytest.fixture
def namespace() -> str:
    """A fresh namespace per test, so tests never see each other's records."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def schema_registry_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real schema registry: ``RLSTREAM_TEST_SCHEMA_REGISTRY``, or a local Apicurio
    Registry the test run starts (``rlstream registry start``) and stops at the end."""
    if os.environ.get("RLSTREAM_TEST_SCHEMA_REGISTRY"):
        yield os.environ["RLSTREAM_TEST_SCHEMA_REGISTRY"]
        return
    from pipeline.kafka.registry_server import LocalRegistry, RegistryServerConfig

    server = LocalRegistry(
        RegistryServerConfig(data_dir=tmp_path_factory.mktemp("registry"), port=free_port_pair(2))
    )
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def schema_registry(schema_registry_url: str) -> Iterator[SchemaRegistry]:
    """This process's codecs resolve through the registry for the test's duration, as
    with ``--schema-registry``."""
    from pipeline.records.registry import RegistryConfig, SchemaRegistry
    from pipeline.records.schema_store import default_store

    store = default_store()
    store.registry = SchemaRegistry(RegistryConfig(schema_registry_url))
    try:
        yield store.registry
    finally:
        store.registry = None
