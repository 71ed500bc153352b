"""``rlstream registry``: a local schema registry (Apicurio Registry, Confluent's API)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from pipeline.cli.common import add_json_arg, env_default, print_result

REGISTRY_DIR = Path(".rlstream/registry")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "registry",
        help="start, stop or inspect a local schema registry (Apicurio, Confluent's API)",
    )
    p.add_argument(
        "action",
        choices=["start", "stop", "status"],
        help="start it (idempotent; fetches Apicurio with Maven once, needs Java 21+), "
        "stop it, or say whether it runs and answers",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path(env_default("RLSTREAM_REGISTRY_DIR", str(REGISTRY_DIR)) or REGISTRY_DIR),
        help="its schemas (an H2 database) and log (env RLSTREAM_REGISTRY_DIR)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=int(env_default("RLSTREAM_REGISTRY_PORT", "8081") or 8081),
        help="HTTP port on 127.0.0.1; health and metrics on the next one "
        "(env RLSTREAM_REGISTRY_PORT)",
    )
    p.add_argument(
        "--user",
        default=None,
        help="start: every request needs HTTP basic auth as this user (clients: "
        "--schema-registry-user)",
    )
    p.add_argument(
        "--password",
        default=None,
        help="start: its password (env RLSTREAM_SCHEMA_REGISTRY_PASSWORD, the variable "
        "clients read too; prefer it to the flag)",
    )
    add_json_arg(p)
    p.set_defaults(func=cmd_registry)


def cmd_registry(args: argparse.Namespace) -> int:
    from pipeline.kafka.registry_server import LocalRegistry, RegistryServerConfig

    password = args.password or os.environ.get("RLSTREAM_SCHEMA_REGISTRY_PASSWORD")
    registry = LocalRegistry(
        RegistryServerConfig(
            data_dir=args.data_dir,
            port=args.port,
            user=args.user,
            password=password if args.user else None,
        )
    )
    if args.action == "start":
        was_running = registry.running()
        state = registry.start()
        word = "already running" if was_running else "started"
        print_result(
            args,
            dict(state, already_running=was_running),
            f"registry {word} url={state['url']} pid={state['pid']} "
            f"data_dir={registry.data_dir}\n"
            f"use it with --schema-registry {state['url']} "
            f"(or export RLSTREAM_SCHEMA_REGISTRY={state['url']})",
        )
        return 0
    if args.action == "stop":
        stopped = registry.stop()
        print_result(
            args,
            {"stopped": stopped},
            "registry stopped" if stopped else "registry was not running",
        )
        return 0
    status = registry.status()
    if not status["running"]:
        print_result(args, status, f"registry not running (data_dir={status['data_dir']})")
        return 3
    print_result(
        args, status, f"registry running url={status['url']} answering={status['answering']}"
    )
    return 0
