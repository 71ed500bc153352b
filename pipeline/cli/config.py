"""``rlstream config show``: a process's configuration, resolved from its defaults, a
``--config`` file, environment variables and flags, as the process would run it."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pipeline.settings import add_flags, resolve, to_mapping


def register(sub: Any) -> None:
    from connectors.serve import ServeConfig
    from pipeline.launch.config import RunConfig
    from pipeline.rollout.config import EvalConfig, ProducerConfig
    from pipeline.train.config import SFTConfig, TrainerConfig

    p = sub.add_parser(
        "config", help="print a resolved configuration (of produce, train, sft, run, eval or env)"
    )
    actions = p.add_subparsers(dest="config_action", required=True)
    show = actions.add_parser("show", help="print the resolved configuration as JSON")
    which = show.add_subparsers(dest="config_of", required=True)
    for name, cls in (
        ("produce", ProducerConfig),
        ("train", TrainerConfig),
        ("sft", SFTConfig),
        ("run", RunConfig),
        ("eval", EvalConfig),
        ("env", ServeConfig),
    ):
        q = which.add_parser(
            name,
            help=f"the configuration of rlstream {name}",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        add_flags(q, cls)
        q.set_defaults(func=cmd_config_show, settings=cls)


def cmd_config_show(args: argparse.Namespace) -> int:
    cfg = resolve(args.settings, args)
    print(json.dumps(to_mapping(cfg), indent=2, sort_keys=True))
    return 0
