"""The ``rlstream`` command line: one entry point, one sub-command per job.

Each command group lives in its own module of this package, which registers its parser;
flags that name a cluster or a namespace default to environment variables, shown in
``--help``. Every long-running command prints progress and stops cleanly on SIGINT or
SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from pipeline.cli import bench, broker, check, config, env, model, produce, replay, run, train
from pipeline.errors import RlstreamError

COMMANDS = (broker, replay, env, run, check, produce, train, model, bench, config)


def version_line() -> str:
    """rlstream's version and those of the libraries it trains and streams with."""
    from pipeline.observe.provenance import versions

    found = versions()
    own = found.pop("rlstream")
    python = found.pop("python")
    return f"rlstream {own} ({', '.join(f'{k} {v}' for k, v in found.items())}; Python {python})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlstream",
        description="Asynchronous RL for LLM agents with Apache Kafka between rollout "
        "producers and trainers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--version", action="version", version=version_line(), help="show versions and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    for chatty in ("absl", "jax._src.xla_bridge", "matplotlib"):  # orbax, backends, fonts
        logging.getLogger(chatty).setLevel(logging.WARNING)
    try:
        return int(args.func(args))
    except RlstreamError as e:
        print(f"rlstream: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rlstream: interrupted", file=sys.stderr)
        return 130
