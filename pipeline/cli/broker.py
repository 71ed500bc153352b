"""``rlstream broker`` and ``rlstream topics``: the local Kafka and a namespace's topics."""

from __future__ import annotations

import argparse
import os
from typing import Any

from pipeline.cli.common import (
    add_broker_args,
    add_json_arg,
    add_kafka_args,
    add_namespace_arg,
    kafka_config,
    print_result,
)


def register(sub: Any) -> None:
    p = sub.add_parser("broker", help="start, stop or inspect the local Apache Kafka (KRaft)")
    p.add_argument("action", choices=["start", "stop", "status"])
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="1, or 3 for a local cluster with replication 3 and min.insync.replicas 2",
    )
    add_broker_args(p)
    p.add_argument(
        "--sasl-username",
        dest="broker_sasl_username",
        default=None,
        help="start: clients must authenticate with SASL/SCRAM-SHA-512 as this user (set "
        "when the data directory is first formatted)",
    )
    p.add_argument(
        "--sasl-password",
        dest="broker_sasl_password",
        default=None,
        help="its password (env RLSTREAM_SASL_PASSWORD; prefer the variable to the flag)",
    )
    add_json_arg(p)
    p.set_defaults(func=cmd_broker)

    p = sub.add_parser("topics", help="create a namespace's topics (idempotent)")
    p.add_argument("action", choices=["create"])
    add_namespace_arg(p)
    p.add_argument("--envs", required=True, help="comma-separated environment names")
    p.add_argument("--partitions", type=int, default=4, help="partitions per rollout topic")
    p.add_argument(
        "--replication", type=int, default=None, help="replication factor (default: the broker's)"
    )
    add_kafka_args(p)
    add_json_arg(p)
    p.set_defaults(func=cmd_topics)


def cmd_broker(args: argparse.Namespace) -> int:
    from pipeline.kafka.broker import BrokerConfig, LocalBroker

    password = args.broker_sasl_password or os.environ.get("RLSTREAM_SASL_PASSWORD")
    broker = LocalBroker(
        BrokerConfig(
            data_dir=args.data_dir,
            nodes=args.nodes,
            port=args.port,
            sasl_username=args.broker_sasl_username,
            sasl_password=password if args.broker_sasl_username else None,
        )
    )
    if args.action == "start":
        was_running = broker.running()
        state = broker.start()
        word = "already running" if was_running else "started"
        pids = ",".join(str(n["pid"]) for n in state["nodes"])
        print_result(
            args,
            {
                "bootstrap": state["bootstrap"],
                "security_protocol": state.get("security_protocol", "PLAINTEXT"),
                "nodes": state["nodes"],
                "already_running": was_running,
            },
            f"broker {word} bootstrap={state['bootstrap']} nodes={len(state['nodes'])} "
            f"security={state.get('security_protocol', 'PLAINTEXT')} pids={pids} "
            f"data_dir={broker.data_dir}",
        )
        return 0
    if args.action == "stop":
        stopped = broker.stop()
        print_result(
            args, {"stopped": stopped}, "broker stopped" if stopped else "broker was not running"
        )
        return 0
    status = broker.status()
    if not status["running"]:
        print_result(args, status, f"broker not running (data_dir={status['data_dir']})")
        return 3
    print_result(
        args,
        status,
        f"broker running bootstrap={status['bootstrap']} "
        f"answering={status['answering']} nodes={len(status['nodes'])}",
    )
    return 0


def cmd_topics(args: argparse.Namespace) -> int:
    from pipeline.kafka.topics import ensure_topics, namespace_topics

    envs = [e.strip() for e in args.envs.split(",") if e.strip()]
    specs = namespace_topics(args.namespace, envs, args.partitions, replication=args.replication)
    states = ensure_topics(kafka_config(args), specs)
    lines = [
        f"{s.action:8} {s.name} partitions={s.partitions} replication={s.replication} "
        + " ".join(f"{k}={v}" for k, v in sorted(s.config.items()))
        for s in states
    ]
    print_result(
        args,
        {"topics": [s.__dict__ | {"config": dict(s.config)} for s in states]},
        "\n".join(lines),
    )
    return 0
