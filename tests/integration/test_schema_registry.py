"""Against a real broker and a real schema registry (Apicurio Registry, started by the
test run): records framed in Confluent's wire format, read by confluent-kafka's own Avro
deserializer, by rlstream's readers with the registry, and refused without it."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from confluent_kafka import Consumer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import ensure_topics, namespace_topics, rollout_topic
from pipeline.kafka.transport import Decoded, Rejected, TrajectoryReader, TrajectoryWriter
from pipeline.records.ledger import read_ledger
from pipeline.records.registry import RegistryConfig, RegistryError, SchemaRegistry
from pipeline.records.schema_store import default_store, parse
from pipeline.records.trajectory import Trajectory, Turns
from pipeline.testing import make_trajectory
from pipeline.train.trainer import Trainer
from tests.integration.test_broker import rlstream
from tests.sockets import listening

pytestmark = pytest.mark.integration


def _subject(url: str, subject: str) -> Any:
    with urllib.request.urlopen(f"{url}/subjects/{subject}/versions/latest", timeout=10) as r:
        return json.loads(r.read())


def _compatibility(url: str, subject: str) -> str:
    with urllib.request.urlopen(f"{url}/config/{subject}", timeout=10) as r:
        return str(json.loads(r.read())["compatibilityLevel"])


def _write(kafka: KafkaConfig, namespace: str, n: int) -> tuple[TrajectoryWriter, list[Trajectory]]:
    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    writer = TrajectoryWriter(kafka, namespace)
    sent = []
    rng = np.random.default_rng(3)
    for i in range(n):
        t = make_trajectory(
            300, rng=rng, env="math", group_id="g0", group_size=n, group_index=i, versions=(2, 5)
        )
        writer.write(t)
        sent.append(t)
    writer.flush()
    return writer, sent


def _same(got: Trajectory, want: Trajectory) -> None:
    for f in dataclasses.fields(Trajectory):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f.name
        elif isinstance(a, (list, tuple)):
            assert list(a) == list(b), f.name
        else:
            assert a == b, f.name


def _confluent_deserializer(url: str) -> AvroDeserializer:
    """confluent-kafka's own ``AvroDeserializer``, finding subjects by topic name as rlstream
    writes them: newer clients otherwise first ask the registry for the topic's
    "associations", one more request (Confluent's newer API) on the path of every read.
    A request that never answers fails the test in 30 s, not at pytest's timeout."""
    conf = {"subject.name.strategy.type": "TOPIC"}
    if "subject.name.strategy.type" not in getattr(AvroDeserializer, "_default_conf", {}):
        conf = {}
    return AvroDeserializer(SchemaRegistryClient({"url": url, "timeout": 30}), conf=conf)


def test_confluent_kafkas_own_deserializer_reads_every_field(
    kafka: KafkaConfig, namespace: str, schema_registry: SchemaRegistry, schema_registry_url: str
) -> None:
    _, sent = _write(kafka, namespace, 4)
    topic = rollout_topic(namespace, "math")
    subject = f"{topic}-value"
    registered = _subject(schema_registry_url, subject)
    assert json.loads(registered["schema"])["name"] == "Trajectory"
    assert _compatibility(schema_registry_url, subject) == "BACKWARD"

    deserializer = _confluent_deserializer(schema_registry_url)
    consumer = Consumer(
        {
            "bootstrap.servers": kafka.bootstrap,
            "group.id": f"{namespace}.confluent",
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([topic])
    values: list[dict[str, Any]] = []
    raw: list[bytes] = []
    try:
        while len(values) < len(sent):
            msg = consumer.poll(30)
            assert msg is not None, "records did not arrive"
            assert msg.error() is None, msg.error()
            raw.append(msg.value())
            values.append(
                deserializer(msg.value(), SerializationContext(topic, MessageField.VALUE))
            )
    finally:
        consumer.close()
    assert {v[:5] for v in raw} == {b"\x00" + registered["id"].to_bytes(4, "big")}
    for value, want in zip(values, sent, strict=True):
        for name in ("tokens", "loss_mask", "logprobs"):
            array = getattr(want, name)
            assert value[name]["dtype"] == str(array.dtype)
            assert value[name]["shape"] == list(array.shape)
            assert value[name]["data"] == array.tobytes()
        assert value["version_spans"] == [s._asdict() for s in want.version_spans]
        assert value["turns"] == []  # version 2: the turns are columns
        turns = Turns.of(want.turns)
        for name, array in (
            ("turn_roles", turns.roles),
            ("turn_starts", turns.starts),
            ("turn_ends", turns.ends),
            ("turn_latency_s", turns.latency_s),
        ):
            assert value[name] == {
                "dtype": str(array.dtype),
                "shape": list(array.shape),
                "data": array.tobytes(),
            }, name
        assert value["turn_tool_names"] == list(turns.tool_names)
        assert value["timings"] == want.timings._asdict()
        for name in (
            "trajectory_id",
            "group_id",
            "group_size",
            "group_index",
            "task_id",
            "producer_id",
            "env",
            "tokenizer_id",
            "reward",
            "status",
        ):
            assert value[name] == getattr(want, name), name
        assert value["rewards"] == dict(want.rewards)
        assert value["metadata"] == dict(want.metadata)

    # rlstream's own reader resolves the id through the registry
    reader = TrajectoryReader(kafka, [topic], f"{namespace}.trainer")
    got = reader.read(len(sent))
    reader.close()
    assert all(isinstance(r, Decoded) for r in got)
    by_id = {r.trajectory.trajectory_id: r.trajectory for r in got if isinstance(r, Decoded)}
    for want in sent:
        _same(by_id[want.trajectory_id], want)


def test_without_the_registry_framed_records_are_refused_not_fatal(
    kafka: KafkaConfig, namespace: str, schema_registry: SchemaRegistry
) -> None:
    _write(kafka, namespace, 2)
    store = default_store()
    store.registry = None
    reader = TrajectoryReader(kafka, [rollout_topic(namespace, "math")], f"{namespace}.t")
    got = reader.read(2)
    reader.close()
    assert all(isinstance(r, Rejected) and r.error.reason == "unknown_schema" for r in got)
    assert "--schema-registry" in str(got[0].error)  # type: ignore[union-attr]

    # a registry that does not answer: refused with the reason, nothing raised; asked
    # three times for the first record, and not again for the second, a moment later
    dead = SchemaRegistry(RegistryConfig("http://127.0.0.1:9/apis/ccompat/v7"))
    store.registry = dead
    reader = TrajectoryReader(kafka, [rollout_topic(namespace, "math")], f"{namespace}.u")
    got = reader.read(2)
    reader.close()
    assert all(isinstance(r, Rejected) and r.error.reason == "registry_unavailable" for r in got)
    assert "did not answer" in str(got[0].error)  # type: ignore[union-attr]
    assert "not asked again" in str(got[1].error)  # type: ignore[union-attr]
    assert dead.requests == 3


def test_a_producer_whose_schema_the_registry_refuses_stops_at_start(
    bootstrap: str, namespace: str, schema_registry_url: str
) -> None:
    topic = rollout_topic(namespace, "guess")
    registry = SchemaRegistry(RegistryConfig(schema_registry_url))
    incompatible = {
        "type": "record",
        "name": "Trajectory",
        "namespace": "rlstream",
        "fields": [{"name": "only", "type": "int"}],
    }
    registry.register(f"{topic}-value", json.dumps(incompatible))
    proc = rlstream(
        "produce",
        "--bootstrap",
        bootstrap,
        "--namespace",
        namespace,
        "--env",
        "guess",
        "--max-episodes",
        "4",
        "--schema-registry",
        schema_registry_url,
        env={"RLSTREAM_DEBUG": ""},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    error = [line for line in proc.stderr.splitlines() if line.startswith("rlstream:")]
    assert len(error) == 1, proc.stderr
    assert f"subject {topic}-value" in error[0] and "HTTP 409" in error[0]
    assert "Incompatible" in error[0] or "incompatible" in error[0]


def test_registry_answers_are_checked(schema_registry_url: str) -> None:
    registry = SchemaRegistry(RegistryConfig(schema_registry_url))
    assert registry.schema_text(2**30) is None  # no such id: None, remembered
    before = registry.requests
    assert registry.schema_text(2**30) is None and registry.requests == before
    with pytest.raises(RegistryError, match="HTTP 4"):
        registry.register("rlstream-test-bad-value", "{not json")
    with pytest.raises(RegistryError, match="did not answer"):
        SchemaRegistry(RegistryConfig("http://127.0.0.1:9")).schema_text(1)
    with pytest.raises(RegistryError, match="http"):
        RegistryConfig("ftp://example")
    with pytest.raises(RegistryError, match="both"):
        RegistryConfig("http://x", username="u")


@pytest.mark.slow
def test_registry_start_binds_loopback_only_keeps_ids_and_can_require_a_user(
    tmp_path: Any,
) -> None:
    from tests.conftest import free_port_pair

    port = free_port_pair(2)
    where = ["--data-dir", str(tmp_path / "reg"), "--port", str(port), "--json"]
    env = {"RLSTREAM_SCHEMA_REGISTRY_PASSWORD": "s3cret: #=!"}

    def cli(action: str, *extra: str) -> tuple[int, dict[str, Any]]:
        done = rlstream("registry", action, *where, *extra, env=env)
        return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])

    rc, state = cli("start")
    try:
        assert rc == 0 and state["url"] == f"http://127.0.0.1:{port}/apis/ccompat/v7"
        bound = listening(state["pid"])
        assert {p for _, p in bound} == {port, port + 1}, bound
        assert {str(a) for a, _ in bound} == {"127.0.0.1"}, bound
        registry = SchemaRegistry(RegistryConfig(state["url"]))
        schema = default_store().reader("Trajectory")
        schema_id = registry.register("restart-value", schema.text)
        assert cli("start")[1]["already_running"] is True
        assert cli("stop") == (0, {"stopped": True})
        assert cli("status")[0] == 3

        # again, on the same data, now asking for credentials: the id is still there
        rc, state = cli("start", "--user", "alice")
        assert rc == 0
        with pytest.raises(RegistryError, match=r"refused the credentials \(HTTP 401\)"):
            SchemaRegistry(RegistryConfig(state["url"])).schema_text(schema_id)
        with pytest.raises(RegistryError, match="HTTP 401"):
            SchemaRegistry(RegistryConfig(state["url"], "alice", "wrong")).schema_text(schema_id)
        authed = SchemaRegistry(RegistryConfig(state["url"], "alice", "s3cret: #=!"))
        text = authed.schema_text(schema_id)
        assert text is not None and parse(json.loads(text)).fingerprint == schema.fingerprint
        rc, status = cli("status")
        assert rc == 0 and status["answering"] is True
        config = tmp_path / "reg" / "config" / "application.properties"
        assert config.stat().st_mode & 0o077 == 0  # the password: owner only
        assert "s3cret" not in " ".join(open(f"/proc/{state['pid']}/cmdline").read().split("\0"))
    finally:
        cli("stop")


def test_version_1_then_version_2_in_one_subject_both_read(
    kafka: KafkaConfig, namespace: str, schema_registry: SchemaRegistry, schema_registry_url: str
) -> None:
    """The registry's own BACKWARD check (Apache Avro's, in Java) accepts version 2 after
    version 1; a topic holding both reads whole, by rlstream and by confluent-kafka."""
    from pipeline.records.codec import AvroCodec, to_avro_dict
    from pipeline.records.registry import framing
    from pipeline.records.schema_store import SchemaStore, history

    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    topic = rollout_topic(namespace, "math")
    (v1,) = history("Trajectory")
    v1_id = schema_registry.register(f"{topic}-value", v1.text)
    old_store = SchemaStore()
    old_store.use_reader(v1)
    old_codec = AvroCodec("Trajectory", old_store)
    rng = np.random.default_rng(9)
    sent = [make_trajectory(120, rng=rng, env="math", turns=5) for _ in range(4)]
    writer = TrajectoryWriter(kafka, namespace)
    for i, t in enumerate(sent):
        if i % 2:
            writer.write(t)  # version 2, registered now under the same subject
        else:
            d = to_avro_dict(t)
            for name in [k for k in d if k.startswith("turn_")]:
                del d[name]
            d["turns"] = [turn._asdict() for turn in t.turns]
            value = old_codec.encode(d, framing(v1_id))
            writer.write_encoded(t.env, t.group_id, value, writer.codec.headers(t))
    writer.flush()
    versions = json.loads(
        urllib.request.urlopen(f"{schema_registry_url}/subjects/{topic}-value/versions").read()
    )
    assert len(versions) == 2

    reader = TrajectoryReader(kafka, [topic], f"{namespace}.trainer")
    got = reader.read(len(sent))
    reader.close()
    by_id = {r.trajectory.trajectory_id: r.trajectory for r in got if isinstance(r, Decoded)}
    assert len(by_id) == len(sent)
    for want in sent:
        _same(by_id[want.trajectory_id], want)

    deserializer = _confluent_deserializer(schema_registry_url)
    consumer = Consumer(
        {
            "bootstrap.servers": kafka.bootstrap,
            "group.id": f"{namespace}.confluent",
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([topic])
    seen = []
    try:
        while len(seen) < len(sent):
            msg = consumer.poll(30)
            assert msg is not None and msg.error() is None
            seen.append(deserializer(msg.value(), SerializationContext(topic, MessageField.VALUE)))
    finally:
        consumer.close()
    for value, want in zip(seen, sent, strict=True):
        assert value["trajectory_id"] == want.trajectory_id
        assert value["tokens"]["data"] == want.tokens.tobytes()
        if "turn_roles" in value:  # a version-2 record
            assert value["turn_roles"]["data"] == Turns.of(want.turns).roles.tobytes()
        else:
            assert value["turns"] == [turn._asdict() for turn in want.turns]


class _Switch:
    """A TCP path to the real registry that can be cut: while ``down``, every connection
    is closed as soon as it is accepted (the client sees a dropped connection)."""

    def __init__(self, target: str) -> None:
        parsed = urllib.parse.urlsplit(target)
        self._to = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}{parsed.path}"
        self.down = True
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.down:
                client.close()
                continue
            upstream = socket.create_connection(self._to, timeout=10)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()


def test_a_trainer_holds_records_while_the_registry_is_down_and_trains_them_after(
    kafka: KafkaConfig, namespace: str, schema_registry: SchemaRegistry, tmp_path: Path
) -> None:
    """Records framed for the registry, read while it does not answer, are not valid or
    invalid: the trainer holds them (nothing dead-lettered, dropped, settled or
    committed), pauses reading at its bound, and trains every one once it answers."""
    from tests.integration.test_trainer import produce_groups, trainer_config

    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    ids = produce_groups(kafka, namespace, 2)  # framed: the fixture's registry is on
    switch = _Switch(schema_registry.config.url)
    default_store().registry = SchemaRegistry(RegistryConfig(switch.url))  # knows no id
    trainer = Trainer(trainer_config(namespace, tmp_path, max_buffered=4), kafka)
    thread = threading.Thread(target=trainer.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while len(trainer.held) < len(ids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(trainer.held) == len(ids) and trainer.reading_paused
        time.sleep(7)  # past a retry of the held records, still down
        assert len(trainer.held) == len(ids) and trainer.held.total >= 2 * len(ids)
        assert trainer.version == 0 and trainer.deadlettered == 0 and not trainer.drops
        assert trainer.tracker.low((rollout_topic(namespace, "math"), 0)) == 0
        switch.down = False
        deadline = time.monotonic() + 60
        while trainer.version < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        trainer.stop()
        thread.join(60)
        switch.close()
    assert trainer.version == 1 and not trainer.held and not trainer.reading_paused
    assert trainer.deadlettered == 0 and not trainer.drops
    trained = {t[0] for e in read_ledger(tmp_path / "ledger.jsonl") for t in e["trained"]}
    assert trained == set(ids)


def _read_framed(
    kafka: KafkaConfig, url: str, topic: str, group: str, at_least: int = 1
) -> list[dict[str, Any]]:
    """Every value of ``topic`` (tombstones skipped), read by confluent-kafka's own
    ``AvroDeserializer`` by schema id: it fails on anything not in the registry framing."""
    deserializer = _confluent_deserializer(url)
    consumer = Consumer(
        {
            "bootstrap.servers": kafka.bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": True,
        }
    )
    consumer.subscribe([topic])
    values: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    ends = 0
    try:
        while time.monotonic() < deadline and not (ends and len(values) >= at_least):
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            if msg.error() is not None:
                ends += msg.error().code() == -191  # _PARTITION_EOF
                continue
            if msg.value() is None:
                continue
            value = deserializer(msg.value(), SerializationContext(topic, MessageField.VALUE))
            assert isinstance(value, dict), topic
            values.append(value)
    finally:
        consumer.close()
    assert len(values) >= at_least, f"{topic}: {len(values)} values"
    return values


def test_every_topic_of_a_registry_run_reads_with_confluents_deserializer(
    bootstrap: str, kafka: KafkaConfig, schema_registry_url: str, tmp_path: Path
) -> None:
    """``rlstream run --schema-registry``: rollouts, weights announcements and the files
    they name, producer heartbeats and telemetry are all in Confluent's framing, each under
    its own ``<topic>-value`` subject, and read by ``AvroDeserializer``."""
    from pipeline.kafka.topics import (
        producers_topic,
        telemetry_topic,
        weights_data_topic,
        weights_topic,
    )
    from tests.integration.test_run import SHORT

    namespace = f"t{os.urandom(5).hex()}"
    done = rlstream(
        "run",
        f"--bootstrap={bootstrap}",
        f"--run-dir={tmp_path / 'run'}",
        f"--namespace={namespace}",
        f"--schema-registry={schema_registry_url}",
        "--steps=2",
        "--eval-episodes=0",
        "--json",
        *[f for f in SHORT if not f.startswith("--eval")],
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    expected = {
        rollout_topic(namespace, "guess"): "Trajectory",
        weights_topic(namespace): "WeightsAnnouncement",
        weights_data_topic(namespace): "WeightsChunk",
        producers_topic(namespace): "ProducerHeartbeat",
        telemetry_topic(namespace): "Telemetry",
    }
    for topic, record in expected.items():
        assert (
            json.loads(_subject(schema_registry_url, f"{topic}-value")["schema"])["name"] == record
        )
        values = _read_framed(kafka, schema_registry_url, topic, f"{namespace}.audit")
        if record == "WeightsAnnouncement":
            assert {v["policy_version"] for v in values} >= {2}
            assert all(v["transfer"]["topic"] == weights_data_topic(namespace) for v in values)
        if record == "WeightsChunk":  # the files of every version, as Confluent reads them
            assert {v["policy_version"] for v in values} >= {1, 2}
            assert all(hashlib.sha256(v["data"]).hexdigest() == v["sha256"] for v in values)


def test_dead_letters_are_framed_for_the_registry(
    kafka: KafkaConfig, namespace: str, schema_registry: SchemaRegistry, schema_registry_url: str
) -> None:
    from pipeline.errors import RecordDecodeError
    from pipeline.kafka.message import Record
    from pipeline.kafka.topics import deadletter_topic
    from pipeline.train.intake import DeadLetters

    ensure_topics(kafka, namespace_topics(namespace, ["math"], 1))
    producer = kafka.producer()
    letters = DeadLetters(producer, namespace, "trainer")
    bad = Record(rollout_topic(namespace, "math"), 0, 7, 0, b"g", b"\xc3\x01 junk")
    letters.send(bad, RecordDecodeError("truncated", "7 bytes"))
    assert producer.flush(30) == 0 and letters.failures == 0
    (value,) = _read_framed(kafka, schema_registry_url, deadletter_topic(namespace), namespace)
    assert (value["error_class"], value["value"], value["source_offset"]) == (
        "truncated",
        b"\xc3\x01 junk",
        7,
    )
