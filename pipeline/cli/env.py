"""``rlstream env``: serve a registered environment over the remote protocol, or list them."""

from __future__ import annotations

import argparse
import logging
import signal
from typing import Any

from pipeline.cli.common import add_json_arg
from pipeline.errors import RlstreamError
from pipeline.settings import add_flags, resolve

log = logging.getLogger("rlstream")


def register(sub: Any) -> None:
    from connectors.serve import ServeConfig

    p = sub.add_parser(
        "env",
        help="serve a registered environment over the remote protocol (HTTP or stdio), "
        "or list the registered ones",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "action",
        choices=["serve", "list", "tools", "demos"],
        help="list the registered environments, serve one over HTTP, list the tools "
        "of MCP servers (--tools), or write demonstrations of its scripted solver for "
        "rlstream sft (demos NAME --episodes N -o FILE)",
    )
    p.add_argument("name", nargs="?", help="registered environment name (serve)")
    p.add_argument(
        "--tools",
        action="append",
        default=[],
        metavar="mcp:COMMAND|mcp:URL",
        help="an MCP server whose tools to list (tools; repeatable)",
    )
    p.add_argument("--episodes", type=int, default=300, help="demonstrations to write (demos)")
    p.add_argument("--seed", type=int, default=0, help="seed of the demonstrations' tasks")
    p.add_argument("-o", "--output", default=None, help="the JSONL file to write (demos)")
    p.add_argument(
        "--keep-unsolved",
        action="store_true",
        help="demos: write the conversations the environment does not reward as solved too "
        "(a solver that is sometimes wrong, as transcripts people write are)",
    )
    add_json_arg(p)
    add_flags(p, ServeConfig)
    p.set_defaults(func=cmd_env, settings=ServeConfig)


def cmd_env(args: argparse.Namespace) -> int:
    import asyncio
    import importlib.util

    from connectors.base import ADAPTERS, registered
    from connectors.serve import ServeConfig, SessionHost, serve_http, serve_stdio

    if args.action == "list":
        for name in registered():
            print(name)
        for adapter in ADAPTERS.values():
            installed = importlib.util.find_spec(adapter.package) is not None
            need = "" if installed else f" (needs pip install 'rlstream[{adapter.extra}]')"
            print(f"{adapter.prefix}:NAME  {adapter.what}{need}")
        print("package.module:Class  your own connectors.base.Environment subclass")
        need = "" if importlib.util.find_spec("mcp") else " (needs pip install 'rlstream[envs]')"
        print(f"--tools mcp:COMMAND|mcp:URL  an MCP server's tools, for any environment{need}")
        return 0
    if args.action == "tools":
        return _list_tools(args)
    if args.name:
        args.env = args.name
    if args.action == "demos":
        return _demos(args)
    if not args.name and not args._config_file:
        raise RlstreamError("env serve needs the environment's NAME")
    cfg = resolve(ServeConfig, args)
    host = SessionHost.from_config(cfg)
    if not cfg.stdio and cfg.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning(
            "serving on %s: anyone who can reach it can open sessions (there is no "
            "authentication); put it behind a proxy that authenticates",
            cfg.host,
        )

    async def main() -> None:
        loop = asyncio.get_running_loop()
        serving = asyncio.ensure_future(
            serve_stdio(host) if cfg.stdio else serve_http(host, cfg.host, cfg.port)
        )
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, serving.cancel)
        try:
            await serving
        except asyncio.CancelledError:
            pass

    asyncio.run(main())
    if not cfg.stdio:
        print(f"served {host.requests} requests", flush=True)
    return 0


def _list_tools(args: argparse.Namespace) -> int:
    """``rlstream env tools --tools mcp:...``: each server's tools and their schemas."""
    import asyncio
    import json

    from connectors.mcp import check_spec, list_tools
    from connectors.tools import ToolServerError

    if not args.tools:
        raise RlstreamError("env tools needs --tools mcp:COMMAND or --tools mcp:URL")
    for spec in args.tools:
        check_spec(spec)
    try:
        tools = asyncio.run(list_tools(args.tools))
    except ToolServerError as e:
        raise RlstreamError(str(e)) from None
    if getattr(args, "json", False):
        print(json.dumps({"tools": tools}))
        return 0
    for t in tools:
        print(f"{t['name']}  {t['description'].splitlines()[0] if t['description'] else ''}")
        print(f"    {json.dumps(t['parameters'], sort_keys=True)}")
    print(f"{len(tools)} tools from {len(args.tools)} server(s)")
    return 0


def _demos(args: argparse.Namespace) -> int:
    """``rlstream env demos NAME --episodes N -o FILE``: the scripted solver's solved
    conversations, for ``rlstream sft``."""
    from pathlib import Path

    from connectors.serve import ServeConfig
    from pipeline.cli.common import print_result
    from pipeline.rollout.demos import write_demonstrations

    if not args.name or not args.output:
        raise RlstreamError("env demos needs the environment's NAME and -o FILE")
    cfg = resolve(ServeConfig, args)
    out = Path(args.output)
    done = write_demonstrations(
        cfg.env,
        dict(cfg.env_options),
        args.episodes,
        out,
        args.seed,
        lambda s: print(s, flush=True),
        keep_unsolved=args.keep_unsolved,
    )
    unsolved = "among them" if args.keep_unsolved else "left out"
    print_result(
        args,
        {"figures": done},
        f"wrote {done['written']} demonstrations to {out} ({done['unsolved']} tasks the solver "
        f"did not solve {unsolved})",
    )
    return 0
