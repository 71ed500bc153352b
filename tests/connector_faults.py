"""Misbehaving environments for the connector fault tests, run as real processes.

``python -m tests.connector_faults http`` serves the ``guess`` environment over HTTP
under ``/<mode>/v1/...`` and prints its port; the mode decides what goes wrong with each
step call (sessions and resets always work):

- ``ok``: nothing; ``flaky``: every step call's first try gets a 503, a retry succeeds;
- ``drop``: every step call's first try loses its connection, a retry succeeds;
- ``html500``: every step gets a proxy's HTML error page with status 500;
- ``malformed``: steps answer 200 with a body that is not JSON;
- ``oversized``: steps answer 200 with a 4 MiB JSON body;
- ``nan``: steps answer a reward of NaN; ``hang``: steps never answer.

``python -m tests.connector_faults child MODE`` is a child of the process connector that
answers resets (guess, secret 5) and then, on a step, does MODE: ``ok``, ``hang``,
``garbage`` (writes a line that is not JSON), ``die`` (exits), ``oversized`` (a 4 MiB
line), ``wrong_id``, ``die_first_reset`` (its first reset, marked by a file named in
``FAULT_MARK``, exits without answering).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

MODES = ("ok", "flaky", "drop", "html500", "malformed", "oversized", "nan", "hang")


def serve_http() -> None:
    from aiohttp import web

    from connectors.serve import SessionHost, http_app

    host = SessionHost("guess", {"max_turns": 4})
    seen: set[tuple[str, bytes]] = set()

    def fault(mode: str) -> Any:
        @web.middleware
        async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
            if not request.path.endswith("/step") or mode == "ok":
                return await handler(request)
            body = await request.read()
            first = (request.path, body) not in seen
            seen.add((request.path, body))
            if mode == "flaky" and first:
                return web.json_response(
                    {"version": 1, "error": {"code": "unavailable", "message": "busy"}},
                    status=503,
                )
            if mode == "drop" and first:
                assert request.transport is not None
                request.transport.abort()
                await asyncio.sleep(1)
            if mode == "html500":
                return web.Response(
                    text="<html>Internal Server Error</html>", status=500, content_type="text/html"
                )
            if mode == "malformed":
                return web.Response(text='{"version": 1, "observation": ', status=200)
            if mode == "oversized":
                pad = "x" * (4 << 20)
                return web.json_response(
                    {"version": 1, "observation": pad, "reward": 0, "done": False}
                )
            if mode == "nan":
                return web.Response(
                    text='{"version": 1, "observation": "", "reward": NaN, "done": true}',
                    content_type="application/json",
                )
            if mode == "hang":
                await asyncio.Event().wait()
            return await handler(request)

        return middleware

    root = web.Application()
    for mode in MODES:
        app = http_app(host)
        app.middlewares.append(fault(mode))
        root.add_subapp(f"/{mode}/", app)

    async def main() -> None:
        runner = web.AppRunner(root, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(f"port {runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def child(mode: str) -> None:
    out = sys.stdout.buffer
    for raw in sys.stdin.buffer:
        msg = json.loads(raw)
        rid, op = msg["id"], msg["op"]
        answer: dict[str, Any] = {"version": 1, "id": rid}
        if op == "reset":
            mark = os.environ.get("FAULT_MARK")
            if mode == "die_first_reset" and mark and not os.path.exists(mark):
                open(mark, "w").close()
                os._exit(3)
            answer["observation"] = "Guess my number from 1 to 8."
        elif op == "step":
            if mode == "hang":
                while True:
                    time.sleep(3600)
            if mode == "garbage":
                out.write(b"Traceback (most recent call last): oops\n")
                out.flush()
                continue
            if mode == "die":
                os._exit(1)
            if mode == "oversized":
                answer["observation"] = "x" * (4 << 20)
            if mode == "wrong_id":
                answer["id"] = rid + 7
            solved = msg.get("action", "").strip() == "5"
            answer.update(
                observation=answer.get("observation", "Correct!" if solved else "Higher."),
                reward=1.0 if solved else 0.0,
                done=solved,
                info={},
            )
        elif op == "close":
            answer["closed"] = True
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    if sys.argv[1] == "http":
        serve_http()
    else:
        child(sys.argv[2])
