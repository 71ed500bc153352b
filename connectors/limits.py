"""Connection limits of ``rlstream env serve`` over HTTP.

aiohttp waits without limit for a request's headers: 5,000 clients that each send half
a request line and then nothing held 5,000 connections open for minutes. The server's
listening socket is therefore made here, with a protocol around aiohttp's own that

- closes a connection that has not delivered a request's headers within
  ``header_timeout_s`` of opening (the body has its own bound, in :mod:`connectors.serve`);
- closes at once a connection beyond ``max_connections`` open together.

Idle keep-alive connections are closed by aiohttp after ``keepalive_timeout``, which the
server sets to the same bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: seconds a new connection has to deliver its first request's headers
HEADER_TIMEOUT_S = 10.0
#: connections served at once; more are closed as they arrive
MAX_CONNECTIONS = 256


class ConnectionGuard:
    """The limits, the connections open now and those that delivered a request (marked
    by :meth:`middleware`)."""

    def __init__(
        self, max_connections: int = MAX_CONNECTIONS, header_timeout_s: float = HEADER_TIMEOUT_S
    ) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.refused = 0  # connections closed for being over the limit
        self.expired = 0  # connections closed for sending no headers in time
        self._served: set[Any] = set()

    def middleware(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def mark(request: web.Request, handler: Any) -> Any:
            self._served.add(request.transport)
            return await handler(request)

        return mark

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _Guarded(self, factory())


class _Guarded(asyncio.Protocol):
    """aiohttp's handler of one connection, within the guard's limits."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard, self.inner = guard, inner
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        g = self.guard
        if g.open >= g.max_connections:
            g.refused += 1
            if g.refused == 1 or g.refused % 1000 == 0:
                log.warning(
                    "connections over the limit closed count=%d limit=%d",
                    g.refused,
                    g.max_connections,
                )
            transport.abort()
            return
        g.open += 1
        self.counted = True
        self.timer = asyncio.get_running_loop().call_later(g.header_timeout_s, self._expire)
        self.inner.connection_made(transport)

    def _expire(self) -> None:
        if self.transport is not None and self.transport not in self.guard._served:
            self.guard.expired += 1
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.counted:
            return
        self.guard.open -= 1
        if self.timer is not None:
            self.timer.cancel()
        self.guard._served.discard(self.transport)
        self.inner.connection_lost(exc)


async def listen(runner: Any, guard: ConnectionGuard, address: str, port: int) -> asyncio.Server:
    """A listening socket on ``address:port`` serving ``runner`` (an aiohttp runner
    already set up) through ``guard``."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(guard.wrap(runner.server), address, port, reuse_address=True)
