"""``rlstream broker`` and ``rlstream topics``: the local Kafka and a namespace's topics."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from pipeline.cli.common import (
    BROKER_DIR,
    add_broker_args,
    add_json_arg,
    add_kafka_args,
    add_namespace_arg,
    kafka_config,
    print_result,
)
from pipeline.errors import InvalidConfigError


def register(sub: Any) -> None:
    p = sub.add_parser("broker", help="start, stop or inspect the local Apache Kafka (KRaft)")
    p.add_argument(
        "action",
        choices=["start", "stop", "status"],
        help="start it (idempotent), stop it, or say whether it runs and answers",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="1, or 3 for a local cluster with replication 3 and min.insync.replicas 2",
    )
    add_broker_args(p, find=True)
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

    p = sub.add_parser(
        "topics",
        help="a namespace's topics: create (idempotent), list, describe or delete",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "action",
        choices=["create", "list", "describe", "delete"],
        help="create the topics of --envs; list or describe the namespace's topics; "
        "delete them (with --yes)",
    )
    add_namespace_arg(p)
    p.add_argument("--envs", default="", help="create: comma-separated environment names")
    p.add_argument("--partitions", type=int, default=4, help="create: partitions per rollout topic")
    p.add_argument(
        "--replication",
        type=int,
        default=None,
        help="create: replication factor (None: the broker's)",
    )
    p.add_argument(
        "--yes", action="store_true", help="delete: delete without asking (the records are lost)"
    )
    add_kafka_args(p)
    add_json_arg(p)
    p.set_defaults(func=cmd_topics)


def broker_dir(args: argparse.Namespace) -> Path:
    """The data directory ``broker`` acts on: the one given (flag or environment);
    otherwise for ``status`` and ``stop`` the one under the current directory if a broker
    was started there, else the one running broker ``broker start`` started anywhere."""
    from pipeline.kafka.broker import STATE_FILE, running_brokers

    if getattr(args, "data_dir", None) is not None:
        return Path(args.data_dir)
    if args.action == "start" or (BROKER_DIR / STATE_FILE).exists():
        return BROKER_DIR
    running = running_brokers()
    if len(running) > 1:
        listed = "; ".join(f"{b.data_dir} ({b.bootstrap})" for b in running)
        raise InvalidConfigError(
            f"{len(running)} local brokers are running: {listed}; say which with --data-dir"
        )
    if running:
        print(f"rlstream: the broker in {running[0].data_dir}", file=sys.stderr)
        return running[0].data_dir
    return BROKER_DIR


def cmd_broker(args: argparse.Namespace) -> int:
    from pipeline.kafka.broker import BrokerConfig, LocalBroker

    password = args.broker_sasl_password or os.environ.get("RLSTREAM_SASL_PASSWORD")
    broker = LocalBroker(
        BrokerConfig(
            data_dir=broker_dir(args),
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
    from pipeline.kafka import topics

    kafka = kafka_config(args)
    if args.action == "create":
        envs = [e.strip() for e in args.envs.split(",") if e.strip()]
        specs = topics.namespace_topics(
            args.namespace, envs, args.partitions, replication=args.replication
        )
        return _print_states(args, topics.ensure_topics(kafka, specs))
    names = topics.list_namespace_topics(kafka, args.namespace)
    if args.action == "list":
        print_result(args, {"topics": names}, "\n".join(names) or f"no topics in {args.namespace}")
        return 0
    if args.action == "describe":
        states = topics.describe_topics(kafka, names) if names else []
        return _print_states(args, states, topics.topic_records(kafka, names))
    if not names:
        print_result(args, {"deleted": []}, f"no topics in {args.namespace}")
        return 0
    if not args.yes:
        raise InvalidConfigError(
            f"this deletes {len(names)} topics and their records ({', '.join(names)}): "
            "add --yes to delete them"
        )
    topics.delete_topics(kafka, names)
    print_result(args, {"deleted": names}, "\n".join(f"deleted  {n}" for n in names))
    return 0


def _print_states(
    args: argparse.Namespace, states: list[Any], records: dict[str, int] | None = None
) -> int:
    rows = [s.__dict__ | {"config": dict(s.config)} for s in states]
    lines = []
    for s, row in zip(states, rows, strict=True):
        held, action = "", f"{s.action:8} "
        if records is not None:
            row["records"] = records.get(s.name, 0)
            held, action = f" records={row['records']}", ""
        lines.append(
            f"{action}{s.name} partitions={s.partitions} replication={s.replication}"
            f"{held} " + " ".join(f"{k}={v}" for k, v in sorted(s.config.items()))
        )
    print_result(args, {"topics": rows}, "\n".join(lines) or f"no topics in {args.namespace}")
    return 0
