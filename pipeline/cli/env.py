"""``rlstream env``: serve a registered environment over the remote protocol, or list them."""

from __future__ import annotations

import argparse
import logging
import signal
from typing import Any

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
        choices=["serve", "list"],
        help="list the registered environments, or serve one over HTTP",
    )
    p.add_argument("name", nargs="?", help="registered environment name (serve)")
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
        return 0
    if args.name:
        args.env = args.name
    elif not args._config_file:
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
