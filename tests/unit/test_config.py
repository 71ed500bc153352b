"""Client and broker configuration: workload defaults, consistent size limits, secrets
kept out of logs, docker-compose agreeing with the local broker."""

from __future__ import annotations

import re
import socket
import time
import uuid
from pathlib import Path

import pytest
import yaml
from confluent_kafka import KafkaError, KafkaException

from pipeline.errors import InvalidConfigError, KafkaAuthError, KafkaClientError
from pipeline.kafka.broker import (
    WORKLOAD_SETTINGS,
    BrokerConfig,
    LocalBroker,
    replication_settings,
)
from pipeline.kafka.client import (
    MAX_MESSAGE_BYTES,
    KafkaConfig,
    SecurityConfig,
    check_access,
    redact,
    wrap_error,
)
from pipeline.kafka.topics import namespace_topics

ROOT = Path(__file__).resolve().parents[2]


def test_producer_defaults_are_safe_and_sized() -> None:
    conf = KafkaConfig().producer_config()
    assert conf["enable.idempotence"] is True
    assert conf["acks"] == "all"
    assert conf["compression.type"] != "none"
    assert conf["message.max.bytes"] == MAX_MESSAGE_BYTES


def test_consumer_defaults_commit_manually_and_fetch_big_records() -> None:
    conf = KafkaConfig().consumer_config("g")
    assert conf["enable.auto.commit"] is False
    assert conf["max.partition.fetch.bytes"] >= MAX_MESSAGE_BYTES
    assert conf["fetch.max.bytes"] >= MAX_MESSAGE_BYTES
    assert conf["receive.message.max.bytes"] > conf["fetch.max.bytes"]


def test_size_limits_agree_across_broker_topics_and_clients() -> None:
    assert int(WORKLOAD_SETTINGS["message.max.bytes"]) == MAX_MESSAGE_BYTES
    assert int(WORKLOAD_SETTINGS["replica.fetch.max.bytes"]) >= MAX_MESSAGE_BYTES
    for spec in namespace_topics("ns", ["a"], 2):
        assert int(spec.config["max.message.bytes"]) == MAX_MESSAGE_BYTES
    assert WORKLOAD_SETTINGS["auto.create.topics.enable"] == "false"


def test_extra_librdkafka_keys_pass_through_and_win() -> None:
    conf = KafkaConfig(extra={"linger.ms": "50", "statistics.interval.ms": "1000"})
    p = conf.producer_config()
    assert p["linger.ms"] == "50" and p["statistics.interval.ms"] == "1000"


def test_secrets_never_appear_in_repr_or_redacted_config() -> None:
    sec = SecurityConfig("SASL_SSL", "SCRAM-SHA-512", "alice", "hunter2")
    kc = KafkaConfig(security=sec)
    assert "hunter2" not in repr(kc)
    conf = kc.producer_config()
    assert conf["sasl.password"] == "hunter2"
    assert "hunter2" not in str(redact(conf))
    assert conf["security.protocol"] == "sasl_ssl"


def test_bad_security_settings_say_what_is_wrong() -> None:
    with pytest.raises(InvalidConfigError, match="username and a password"):
        SecurityConfig("SASL_PLAINTEXT")
    with pytest.raises(InvalidConfigError, match="not one of"):
        SecurityConfig("KERBEROS?")
    with pytest.raises(InvalidConfigError):
        KafkaConfig(bootstrap=" ")


def test_kafka_errors_become_rlstream_errors_with_code_and_retriable() -> None:
    err = KafkaError(KafkaError._TRANSPORT, "broker down", retriable=True)
    wrapped = wrap_error(KafkaException(err), "listing topics")
    assert isinstance(wrapped, KafkaClientError)
    assert wrapped.code == KafkaError._TRANSPORT and wrapped.retriable
    assert "listing topics failed" in str(wrapped)


def test_broker_properties_single_node() -> None:
    props = LocalBroker(BrokerConfig(data_dir=Path("/tmp/x"), port=20000)).properties(0)
    assert props["process.roles"] == "broker,controller"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:20000,CONTROLLER://127.0.0.1:20001"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:20001"
    assert props["min.insync.replicas"] == "1"


def test_broker_properties_three_nodes() -> None:
    broker = LocalBroker(BrokerConfig(data_dir=Path("/tmp/x"), nodes=3, port=20000))
    props = broker.properties(2)
    assert props["node.id"] == "3"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:20004"
    assert props["controller.quorum.voters"].count("@") == 3
    assert props["default.replication.factor"] == "3"
    assert props["min.insync.replicas"] == "2"
    assert broker.config.bootstrap == "127.0.0.1:20000,127.0.0.1:20002,127.0.0.1:20004"


def test_cluster_ids_never_read_as_an_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 0xfb... encodes to a leading "-" in url-safe base64; the next draw does not.
    draws = iter([uuid.UUID(bytes=b"\xfb" + bytes(15)), uuid.UUID(int=1)])
    monkeypatch.setattr(uuid, "uuid4", lambda: next(draws))
    broker = LocalBroker(BrokerConfig(data_dir=tmp_path, port=20000))
    cid = broker._cluster_id()
    assert not cid.startswith("-") and len(cid) == 22
    assert broker._cluster_id() == cid  # persisted for restarts


def test_broker_config_is_validated() -> None:
    with pytest.raises(InvalidConfigError):
        BrokerConfig(nodes=0)
    with pytest.raises(InvalidConfigError):
        BrokerConfig(port=80)


def test_a_scram_broker_requires_authentication_on_its_client_listener() -> None:
    cfg = BrokerConfig(data_dir=Path("/tmp/x"), port=20000, sasl_username="u", sasl_password="p!w")
    props = LocalBroker(cfg).properties(0)
    assert props["listeners"] == "SASL_PLAINTEXT://127.0.0.1:20000,CONTROLLER://127.0.0.1:20001"
    assert props["inter.broker.listener.name"] == "SASL_PLAINTEXT"
    assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    jaas = props["listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config"]
    assert 'username="u" password="p!w";' in jaas
    assert cfg.client_security()["sasl.username"] == "u"
    assert "p!w" not in repr(cfg)
    with pytest.raises(InvalidConfigError, match="both a user name and a password"):
        BrokerConfig(sasl_username="u")
    for bad in ('a"b', "a,b", "a b", "a=b", "a]b", ""):
        with pytest.raises(InvalidConfigError, match="SASL password"):
            BrokerConfig(sasl_username="u", sasl_password=bad)


def test_an_unreachable_cluster_is_reported_with_who_asked() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    kafka = KafkaConfig(
        bootstrap=f"127.0.0.1:{port}",
        security=SecurityConfig(protocol="SASL_PLAINTEXT", username="ann", password="x"),
    )
    start = time.monotonic()
    with pytest.raises(
        KafkaClientError, match=f"nothing accepts connections at 127.0.0.1:{port}"
    ) as e:
        check_access(kafka, timeout_s=60)
    assert "user 'ann' (SCRAM-SHA-512 over SASL_PLAINTEXT)" in str(e.value)
    assert "rlstream broker start" in str(e.value)
    assert not isinstance(e.value, KafkaAuthError)
    # refused connections are reported long before the timeout a slow cluster gets
    assert time.monotonic() - start < 10


def _compose_env() -> dict[str, dict[str, str]]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return {
        name: {k: str(v) for k, v in svc["environment"].items()}
        for name, svc in compose["services"].items()
        if name.startswith("kafka-")
    }


def test_docker_compose_parses_and_has_three_kraft_brokers() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"kafka-1", "kafka-2", "kafka-3", "topics", "producer", "trainer"} <= set(services)
    assert all(re.match(r"apache/kafka:4\.", services[f"kafka-{i}"]["image"]) for i in (1, 2, 3))
    envs = _compose_env()
    assert sorted(e["KAFKA_NODE_ID"] for e in envs.values()) == ["1", "2", "3"]
    assert len({e["CLUSTER_ID"] for e in envs.values()}) == 1
    assert len(next(iter(envs.values()))["CLUSTER_ID"]) == 22  # base64 of a UUID


def test_docker_compose_agrees_with_the_local_broker() -> None:
    expected = {**WORKLOAD_SETTINGS, **replication_settings(3)}
    for name, env in _compose_env().items():
        props = {
            k[len("KAFKA_") :].lower().replace("_", "."): v
            for k, v in env.items()
            if k.startswith("KAFKA_")
        }
        for key, value in expected.items():
            assert props.get(key) == value, f"{name}: {key} is {props.get(key)}, want {value}"


def test_docker_compose_producers_reload_the_weights_the_trainer_writes() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    trainer, producer = services["trainer"], services["producer"]
    assert "--run-dir /checkpoints" in trainer["command"]
    assert "checkpoints:/checkpoints" in trainer["volumes"]
    assert "--checkpoint-root /checkpoints" in producer["command"]
    assert "checkpoints:/checkpoints:ro" in producer["volumes"]
    for svc in (trainer, producer):  # the source and the pip cache stay mounted
        assert ".:/src:ro" in svc["volumes"]


def test_bench_learn_grid_is_every_combination_of_run_settings() -> None:
    from pipeline.bench.learn import grid
    from pipeline.launch.config import RunConfig
    from pipeline.settings import resolve

    combos = grid(["max_staleness=8", "grpo.correction=none,tis,decoupled", "lora.rank=0,4"])
    assert len(combos) == 6
    configs = [resolve(RunConfig, c) for c in combos]
    assert {(c.max_staleness, c.grpo.correction, c.lora.rank) for c in configs} == {
        (8, corr, r) for corr in ("none", "tis", "decoupled") for r in (0, 4)
    }
    assert grid([]) == [{}]
    with pytest.raises(InvalidConfigError, match=r"did you mean grpo\.correction"):
        grid(["grpo.corection=none"])
    with pytest.raises(InvalidConfigError, match="KEY=V1,V2"):
        grid(["max_staleness"])


def test_bench_learn_refuses_a_bad_environment_before_any_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from pipeline.cli.main import main

    config = tmp_path / "recipe.yaml"
    config.write_text("env: guess\nwarm_start:\n  demos: 10\n")
    for flags, says in (
        (["--config", str(config)], "'guess' has no scripted solver"),
        (["--config", str(tmp_path / "none.yaml")], "none.yaml"),
        (["--env", "guess", "--env-option", "noequals"], "'noequals' is not KEY=VALUE"),
        (["--env", "guess", "--env-option", "high=NaN"], "high must be an integer"),
        (["--env", "reasoning-gym:no_such_dataset"], "not registered"),
    ):
        # (no broker answers at that address: a run started would fail otherwise)
        assert main(["bench", "learn", *flags, "--bootstrap", "127.0.0.1:1"]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err


def test_produce_refuses_an_unknown_environment_before_connecting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pipeline.cli.main import main

    start = time.monotonic()
    assert main(["produce", "--env", "nosuchenv", "--bootstrap", "127.0.0.1:1"]) == 2
    assert "unknown environment 'nosuchenv'" in capsys.readouterr().err
    assert time.monotonic() - start < 5  # no connection was attempted


def test_a_weights_source_that_is_none_of_the_three_is_refused_by_name() -> None:
    from pipeline.launch.config import RunConfig
    from pipeline.rollout.config import ProducerConfig

    for make in (ProducerConfig, RunConfig):
        for bad in ("nfs", "", "Cluster", None):
            with pytest.raises(InvalidConfigError, match="auto, directory, cluster"):
                make(weights_source=bad)  # type: ignore[arg-type]
    assert ProducerConfig(weights_source="cluster").weights_source == "cluster"
