"""Flags and helpers every command shares: the cluster, the namespace, JSON output,
metrics and telemetry."""

from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path
from typing import Any

from pipeline.errors import RlstreamError
from pipeline.kafka.client import KafkaConfig, SecurityConfig
from pipeline.launch.cluster import Cluster, checked
from pipeline.launch.stop import StopFlag


def env_default(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def add_kafka_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Kafka cluster")
    g.add_argument(
        "--bootstrap",
        default=env_default("RLSTREAM_BOOTSTRAP"),
        help="bootstrap servers host:port[,...] of an existing cluster "
        "(env RLSTREAM_BOOTSTRAP; neither given: the local broker)",
    )
    g.add_argument(
        "--security-protocol",
        default=env_default("RLSTREAM_SECURITY_PROTOCOL", "PLAINTEXT"),
        choices=["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"],
        help="(env RLSTREAM_SECURITY_PROTOCOL; default %(default)s)",
    )
    g.add_argument(
        "--sasl-mechanism",
        default=env_default("RLSTREAM_SASL_MECHANISM"),
        help="e.g. SCRAM-SHA-512 (env RLSTREAM_SASL_MECHANISM)",
    )
    g.add_argument(
        "--sasl-username",
        default=env_default("RLSTREAM_SASL_USERNAME"),
        help="(env RLSTREAM_SASL_USERNAME)",
    )
    g.add_argument(
        "--sasl-password",
        default=env_default("RLSTREAM_SASL_PASSWORD"),
        help="(env RLSTREAM_SASL_PASSWORD; prefer the variable to the flag)",
    )
    g.add_argument(
        "--ssl-ca",
        default=env_default("RLSTREAM_SSL_CA"),
        help="CA certificate file (env RLSTREAM_SSL_CA)",
    )
    g.add_argument(
        "--kafka-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any librdkafka setting, passed through (repeatable)",
    )
    r = p.add_argument_group("Schema registry")
    r.add_argument(
        "--schema-registry",
        default=env_default("RLSTREAM_SCHEMA_REGISTRY"),
        metavar="URL",
        help="a registry with Confluent's API (Apicurio: http://HOST:PORT/apis/ccompat/v7): "
        "producers register <topic>-value subjects and write Confluent's wire format, "
        "readers resolve its schema ids (env RLSTREAM_SCHEMA_REGISTRY; neither given: "
        "single-object encoding, and registry-framed records are refused)",
    )
    r.add_argument(
        "--schema-registry-user",
        default=env_default("RLSTREAM_SCHEMA_REGISTRY_USER"),
        help="basic-auth user (env RLSTREAM_SCHEMA_REGISTRY_USER)",
    )
    r.add_argument(
        "--schema-registry-password",
        default=env_default("RLSTREAM_SCHEMA_REGISTRY_PASSWORD"),
        help="basic-auth password (env RLSTREAM_SCHEMA_REGISTRY_PASSWORD; prefer the variable)",
    )


def add_telemetry_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-telemetry",
        action="store_true",
        help="do not send spans and metrics to <ns>.telemetry",
    )


def add_metrics_args(p: argparse.ArgumentParser, port_help: str) -> None:
    p.add_argument("--metrics-port", type=int, default=None, help=port_help)
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics port binds (0.0.0.0 for a Prometheus on another host)",
    )


def add_namespace_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--namespace",
        default=env_default("RLSTREAM_NAMESPACE", "rlstream"),
        help="experiment namespace (env RLSTREAM_NAMESPACE; default %(default)s)",
    )


def add_json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json", action="store_true", help="print one JSON object as the last line of output"
    )


BROKER_DIR = Path(".rlstream/broker")


def add_broker_args(p: argparse.ArgumentParser, find: bool = False) -> None:
    """``--data-dir`` and ``--port`` of the local broker; with ``find``, an absent
    ``--data-dir`` is left unset (the command looks for the running broker)."""
    env_dir = env_default("RLSTREAM_BROKER_DIR", "")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path(env_dir) if env_dir else argparse.SUPPRESS if find else BROKER_DIR,
        help=(
            f"local broker state and logs (env RLSTREAM_BROKER_DIR; neither given: {BROKER_DIR}, "
            "and status and stop find a broker started elsewhere)"
            if find
            else "local broker state and logs (env RLSTREAM_BROKER_DIR; default %(default)s)"
        ),
    )
    p.add_argument(
        "--port",
        type=int,
        default=int(env_default("RLSTREAM_BROKER_PORT", "9092") or 9092),
        help="first client port; node i uses port+2i, its controller port+2i+1 "
        "(env RLSTREAM_BROKER_PORT; default %(default)s)",
    )


def add_env_option_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--env-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment constructor option, VALUE read as JSON if it parses "
        "(e.g. high=4, max_turns=6; repeatable)",
    )


def kafka_config(
    args: argparse.Namespace, bootstrap: str | None = None, check: bool = True
) -> KafkaConfig:
    """The cluster the flags name; ``check``: once per process, fail here in one sentence
    when it refuses this client or does not answer."""
    extra = {}
    for item in args.kafka_option:
        key, sep, value = item.partition("=")
        if not sep:
            raise RlstreamError(f"--kafka-option {item!r} is not KEY=VALUE")
        extra[key] = value
    security = SecurityConfig(
        protocol=args.security_protocol,
        sasl_mechanism=args.sasl_mechanism,
        username=args.sasl_username,
        password=args.sasl_password,
        ssl_ca_location=args.ssl_ca,
    )
    kafka = KafkaConfig(
        bootstrap=bootstrap or args.bootstrap or "127.0.0.1:9092", security=security, extra=extra
    )
    use_schema_registry(args)
    return checked(kafka) if check else kafka


def use_schema_registry(args: argparse.Namespace) -> None:
    """Every codec of this process resolves (and producers register) schemas through the
    registry ``--schema-registry`` names, if any."""
    url = getattr(args, "schema_registry", None)
    if not url:
        return
    from pipeline.records.registry import RegistryConfig, SchemaRegistry
    from pipeline.records.schema_store import default_store

    store = default_store()
    if store.registry is None or store.registry.config.url != url:
        store.registry = SchemaRegistry(
            RegistryConfig(url, args.schema_registry_user, args.schema_registry_password)
        )


def print_result(args: argparse.Namespace, result: dict[str, Any], text: str) -> None:
    print(text, flush=True)
    if getattr(args, "json", False):
        print(json.dumps(result, sort_keys=True), flush=True)


def start_metrics(port: int | None, host: str, collect: Any, process: str) -> Any:
    """A Prometheus exporter of ``collect`` on ``port`` (None: no exporter)."""
    if port is None:
        return None
    from pipeline.observe.prometheus import Exporter

    exporter = Exporter(collect, port, host, {"process": process})
    print(f"metrics on {exporter.url}", flush=True)
    return exporter.start()


def start_telemetry(
    args: argparse.Namespace, kafka: KafkaConfig | None, namespace: str, process: str
) -> Any:
    """This process's tracer, shipping spans to ``<ns>.telemetry`` unless --no-telemetry
    (or there is no Kafka, e.g. training from a file)."""
    from pipeline.observe.shipping import kafka_tracer
    from pipeline.observe.telemetry import NullTracer, install

    if getattr(args, "no_telemetry", False) or kafka is None:
        return NullTracer()
    return install(kafka_tracer(process, kafka, namespace))


def run_process(
    args: argparse.Namespace,
    process: Any,
    stop: StopFlag,
    kafka: KafkaConfig | None,
    namespace: str,
    name: str,
    metrics: tuple[int | None, str],
) -> Any:
    """``process.run()`` (a producer or a trainer) with its telemetry and its metrics
    exporter around it; a stop signal becomes ``process.stop()``."""
    tracing = start_telemetry(args, kafka, namespace, name)
    exporter = start_metrics(metrics[0], metrics[1], process.samples, name)

    def stop_on_signal() -> None:
        stop.event.wait()
        process.stop()

    threading.Thread(target=stop_on_signal, daemon=True).start()
    try:
        return process.run()
    finally:
        tracing.close()
        if exporter is not None:
            exporter.close()


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def cluster(args: argparse.Namespace) -> Cluster:
    """``--bootstrap``'s cluster, or the local broker of ``--data-dir``/``--port``."""
    return Cluster(
        kafka_config(args, check=False),
        local=not args.bootstrap,
        data_dir=args.data_dir,
        port=args.port,
    )
