"""The ``rlstream`` command line: one entry point, one sub-command per job.

Each command group lives in its own module of this package, which registers its parser;
flags that name a cluster or a namespace default to environment variables, shown in
``--help``. Every long-running command prints progress and stops cleanly on SIGINT or
SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from pipeline.errors import RlstreamError
from pipeline.launch import stop

#: the modules of pipeline.cli that register the sub-commands, in the order of --help
#: (imported by build_parser, after main has installed the stop flag)
COMMANDS = (
    "broker",
    "registry",
    "replay",
    "env",
    "run",
    "check",
    "produce",
    "train",
    "sft",
    "model",
    "bench",
    "config",
)


def version_line() -> str:
    """rlstream's version and those of the libraries it trains and streams with."""
    from pipeline.observe.provenance import versions

    found = versions()
    own = found.pop("rlstream")
    python = found.pop("python")
    return f"rlstream {own} ({', '.join(f'{k} {v}' for k, v in found.items())}; Python {python})"


class _Version(argparse.Action):
    """``--version``: the versions are looked up only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any) -> None:
        kw.pop("default", None)
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(version_line())
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """A parser whose errors are one sentence (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rlstream",
        description="Asynchronous RL for LLM agents with Apache Kafka between rollout "
        "producers and trainers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--debug",
        action="store_true",
        default=bool(os.environ.get("RLSTREAM_DEBUG")),
        help="show the traceback of an unexpected error (env RLSTREAM_DEBUG)",
    )
    parser.add_argument("--version", action=_Version, help="show versions and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"pipeline.cli.{name}").register(sub)
    for p in subcommands(parser):  # every sub-command's help shows every default
        p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    return parser


def subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser below ``parser``, at any depth."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                out += [child, *subcommands(child)]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    _, restore = stop.begin()  # first: a signal while the process starts is kept
    try:
        return _main(argv)
    finally:
        restore()


def _main(argv: Sequence[str] | None) -> int:
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
    except Exception as e:
        if args.debug:
            raise
        print(
            f"rlstream: unexpected error: {type(e).__name__}: {e} (rerun with --debug for "
            "the traceback, and report it if it is not a problem of your input)",
            file=sys.stderr,
        )
        return 1
