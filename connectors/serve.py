"""``rlstream env serve``: any registered environment served over the remote protocol,
over HTTP (:func:`serve_http`) or JSON lines on stdin/stdout (:func:`serve_stdio`, the
reference child of the ``process`` connector).

One :class:`SessionHost` holds the sessions and makes every call safe to repeat: a reset
names its session, and a step or tool call carries a sequence number, so a retried call
gets the answer of the first instead of acting twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from connectors import protocol
from connectors.base import Environment, Task, make
from connectors.limits import ConnectionGuard, listen

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """What ``rlstream env serve`` serves (``rlstream env serve NAME``)."""

    #: short flags for settings
    FLAGS: ClassVar[dict[str, str | tuple[str, ...]]] = {
        "env_option": "env_options",
        "session_ttl": "session_ttl_s",
        "call_timeout": "call_timeout_s",
    }

    #: registered environment name (rlstream env list)
    env: str = "guess"
    #: environment constructor options (a VALUE is read as JSON if it parses)
    env_options: Mapping[str, Any] = field(default_factory=dict)
    #: address to bind (loopback only by default: there is no authentication)
    host: str = "127.0.0.1"
    #: HTTP port (0: any free one)
    port: int = 8765
    #: JSON lines on stdin/stdout instead of HTTP (a child of the process connector)
    stdio: bool = False
    #: open sessions at most
    max_sessions: int = 1024
    #: close sessions idle this long (s)
    session_ttl_s: float = 600.0
    #: fail an environment call after this long (s)
    call_timeout_s: float = 60.0
    #: bytes one session may hold (its task, its last answer)
    max_session_bytes: int = 256 * 1024
    #: bytes all sessions together may hold
    max_total_bytes: int = 64 * 1024 * 1024


class HostError(Exception):
    """A protocol error answer: HTTP status, code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def body(self) -> dict[str, Any]:
        return protocol.error(self.code, self.message)


@dataclass
class _Session:
    env: Environment
    request: bytes  # digest of the reset request, to tell a repeat from a conflict
    size: int  # bytes this session holds: its task and its last answer
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    answer: dict[str, Any] | HostError | None = None  # of the reset, then of call `seq`
    seq: int = 0
    used: float = field(default_factory=time.monotonic)
    answer_size: int = 0


class SessionHost:
    """Sessions of environment ``env_name`` (made with ``options``), at most
    ``max_sessions`` at once, holding at most ``max_session_bytes`` each (a reset's task
    and the last answer) and ``max_total_bytes`` together (more: 413 for one session,
    503 ``overloaded`` for all); a session idle for ``session_ttl_s`` is closed; an
    environment call running past ``call_timeout_s`` fails that call."""

    def __init__(
        self,
        env_name: str,
        options: Mapping[str, Any] | None = None,
        *,
        max_sessions: int = ServeConfig.max_sessions,
        session_ttl_s: float = ServeConfig.session_ttl_s,
        call_timeout_s: float = ServeConfig.call_timeout_s,
        max_session_bytes: int = ServeConfig.max_session_bytes,
        max_total_bytes: int = ServeConfig.max_total_bytes,
    ) -> None:
        self.env_name, self.options = env_name, dict(options or {})
        probe = make(env_name, **self.options)  # a clear error now, not at the first reset
        self.name = probe.name
        self.tools = probe.tools.describe() if probe.tools is not None else []
        self.max_sessions = max_sessions
        self.session_ttl_s = session_ttl_s
        self.call_timeout_s = call_timeout_s
        self.max_session_bytes, self.max_total_bytes = max_session_bytes, max_total_bytes
        self.sessions: dict[str, _Session] = {}
        self.requests = 0
        self._closing: set[asyncio.Future[None]] = set()

    @classmethod
    def from_config(cls, cfg: ServeConfig) -> SessionHost:
        return cls(
            cfg.env,
            cfg.env_options,
            max_sessions=cfg.max_sessions,
            session_ttl_s=cfg.session_ttl_s,
            call_timeout_s=cfg.call_timeout_s,
            max_session_bytes=cfg.max_session_bytes,
            max_total_bytes=cfg.max_total_bytes,
        )

    def health(self) -> dict[str, Any]:
        return {
            "version": protocol.PROTOCOL_VERSION,
            "status": "ok",
            "env": self.name,
            "tools": self.tools,
            "sessions": len(self.sessions),
            "max_sessions": self.max_sessions,
        }

    async def handle(self, op: str, sid: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Answer one request (``reset``, ``step``, ``tool``, ``close``); raises
        :class:`HostError` for an error answer."""
        self.requests += 1
        if op == "close":
            return await self.close(sid)
        if not sid or len(sid) > 128 or not sid.isprintable():
            raise HostError(400, "bad_request", "session ids are 1-128 printable characters")
        if op == "reset":
            return await self._reset(sid, body)
        if op in ("step", "tool"):
            return await self._call(op, sid, body)
        raise HostError(404, "unknown_operation", f"no operation {op!r}")

    @property
    def held_bytes(self) -> int:
        """Bytes the open sessions hold (their tasks and last answers)."""
        return sum(s.size for s in self.sessions.values())

    async def _reset(self, sid: str, body: Mapping[str, Any]) -> dict[str, Any]:
        text = json.dumps({k: body.get(k) for k in ("seed", "task")}, sort_keys=True)
        request = hashlib.sha256(text.encode()).digest()
        s = self.sessions.get(sid)
        if s is None:
            self._expire()
            if len(self.sessions) >= self.max_sessions:
                raise HostError(503, "overloaded", f"{self.max_sessions} sessions are open")
            if len(text) > self.max_session_bytes:
                raise HostError(
                    413,
                    "too_large",
                    f"a task of {len(text)} bytes (limit {self.max_session_bytes} a session)",
                )
            if self.held_bytes + len(text) > self.max_total_bytes:
                raise HostError(503, "overloaded", f"sessions hold {self.held_bytes} bytes already")
            try:
                what = protocol.task_of(body)
            except protocol.ConnectorError as e:
                raise HostError(400, "bad_request", str(e)) from None
            s = self.sessions[sid] = _Session(
                make(self.env_name, **self.options), request, len(text)
            )
            async with s.lock:
                task = what if isinstance(what, Task) else s.env.sample_task(random.Random(what))
                s.answer = await self._run(
                    s, lambda: s.env.reset(task), lambda obs: {"observation": obs}
                )
                if isinstance(s.answer, dict):
                    s.answer["task_id"] = task.task_id
        async with s.lock:
            s.used = time.monotonic()
            if s.request != request:
                raise HostError(409, "conflict", f"session {sid} was reset with another task")
            if s.seq:
                raise HostError(409, "conflict", f"session {sid} has already stepped")
            return _answer(s.answer)

    async def _call(self, op: str, sid: str, body: Mapping[str, Any]) -> dict[str, Any]:
        s = self.sessions.get(sid)
        if s is None:
            raise HostError(404, "no_session", f"no session {sid} (closed or expired)")
        try:
            seq = protocol.integer(body, "seq")
            if op == "step":
                action = protocol.text(body, "action")
            else:
                name = protocol.text(body, "name", 200)
                arguments = protocol.text(body, "arguments")
        except protocol.ConnectorError as e:
            raise HostError(400, "bad_request", str(e)) from None
        if seq < 1:
            raise HostError(400, "bad_request", f"seq counts calls from 1, not {seq}")
        async with s.lock:
            s.used = time.monotonic()
            if seq == s.seq:  # a repeated call: the first one's answer
                return _answer(s.answer)
            if seq != s.seq + 1:
                raise HostError(409, "conflict", f"sequence {seq} after {s.seq}")
            if isinstance(s.answer, HostError) and s.answer.code == "env_error":
                raise HostError(409, "conflict", "the environment failed; close the session")
            s.seq = seq
            if op == "step":
                s.answer = await self._run(s, lambda: s.env.step(action), protocol.step_message)
            else:
                s.answer = await self._run(
                    s, lambda: s.env.call_tool(name, arguments), lambda r: {"result": str(r)}
                )
            return _answer(s.answer)

    async def _run(self, s: _Session, call: Any, shape: Any) -> dict[str, Any] | HostError:
        try:
            value = await asyncio.wait_for(call(), self.call_timeout_s)
        except KeyError as e:
            return HostError(404, "no_such_tool", f"no tool named {e.args[0]!r}")
        except TimeoutError:
            return HostError(504, "env_timeout", f"no answer in {self.call_timeout_s:g} s")
        except Exception as e:  # the environment's failure: this session's answer
            log.warning("environment %s failed: %r", self.name, e)
            return HostError(500, "env_error", f"{type(e).__name__}: {e}")
        answer = {"version": protocol.PROTOCOL_VERSION, **shape(value)}
        size = len(json.dumps(answer))
        if size > self.max_session_bytes:
            return HostError(
                500, "env_error", f"an answer of {size} bytes (limit {self.max_session_bytes})"
            )
        s.size = s.size - s.answer_size + size
        s.answer_size = size
        return answer

    async def close(self, sid: str) -> dict[str, Any]:
        s = self.sessions.pop(sid, None)
        if s is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(s.env.close(), self.call_timeout_s)
        return {"version": protocol.PROTOCOL_VERSION, "closed": s is not None}

    def _expire(self) -> None:
        now = time.monotonic()
        for sid, s in list(self.sessions.items()):
            if now - s.used > self.session_ttl_s and not s.lock.locked():
                log.info("session %s idle for %.0f s: closed", sid, now - s.used)
                del self.sessions[sid]
                closing = asyncio.ensure_future(s.env.close())
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)

    async def close_all(self) -> None:
        for sid in list(self.sessions):
            await self.close(sid)


def _answer(a: dict[str, Any] | HostError | None) -> dict[str, Any]:
    if isinstance(a, HostError):
        raise a
    assert a is not None
    return a


# -- HTTP ------------------------------------------------------------------------------


def http_app(
    host: SessionHost,
    max_request_bytes: int = protocol.MAX_MESSAGE_BYTES,
    body_timeout_s: float = 10.0,
    guard: ConnectionGuard | None = None,
) -> Any:
    """The aiohttp application serving ``host`` (see docs/environment-protocol.md).
    Every error answer, 413 and 408 included, is the protocol's JSON."""
    from aiohttp import web

    def reply(body: dict[str, Any], status: int = 200) -> web.Response:
        return web.Response(
            body=json.dumps(body).encode(), status=status, content_type="application/json"
        )

    async def health(request: web.Request) -> web.Response:
        return reply(host.health())

    async def call(request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        op = request.match_info.get("op", "close" if request.method == "DELETE" else "reset")
        body: dict[str, Any] = {}
        if request.method != "DELETE":
            try:
                body = protocol.decode(await _body(request), max_request_bytes)
            except TimeoutError:
                return reply(
                    protocol.error("timeout", f"the body did not arrive in {body_timeout_s:g} s"),
                    408,
                )
            except protocol.ConnectorError as e:
                if e.reason == "oversized":
                    return reply(protocol.error("too_large", str(e)), 413)
                return reply(protocol.error("bad_request", str(e)), 400)
        try:
            return reply(await host.handle(op, sid, body))
        except HostError as e:
            return reply(e.body(), e.status)

    async def _body(request: web.Request) -> bytes:
        """The request body: at most ``max_request_bytes`` (more is refused without
        reading it all) within ``body_timeout_s`` (a half-sent body is not waited for)."""
        declared = request.content_length
        if declared is not None and declared > max_request_bytes:
            raise protocol.ConnectorError(
                "oversized", f"a body of {declared} bytes (limit {max_request_bytes})"
            )
        try:
            async with asyncio.timeout(body_timeout_s):
                return await request.read()  # (bounded by client_max_size)
        except web.HTTPRequestEntityTooLarge:
            raise protocol.ConnectorError(
                "oversized", f"a body over {max_request_bytes} bytes"
            ) from None

    app = web.Application(
        client_max_size=max_request_bytes,
        middlewares=[guard.middleware()] if guard is not None else [],
    )
    app.router.add_get("/v1/health", health)
    app.router.add_put("/v1/sessions/{sid}", call)
    app.router.add_delete("/v1/sessions/{sid}", call)
    app.router.add_post("/v1/sessions/{sid}/{op:step|tool}", call)

    async def on_cleanup(app: web.Application) -> None:
        await host.close_all()

    app.on_cleanup.append(on_cleanup)
    return app


async def serve_http(
    host: SessionHost, address: str, port: int, ready: asyncio.Event | None = None
) -> None:
    """Serve until cancelled; prints one line with the bound address when listening."""
    from aiohttp import web

    guard = ConnectionGuard()
    runner = web.AppRunner(
        http_app(host, guard=guard), access_log=None, keepalive_timeout=guard.header_timeout_s
    )
    await runner.setup()
    server = await listen(runner, guard, address, port)
    actual = server.sockets[0].getsockname()[1] if server.sockets else port
    print(
        f"serving environment {host.name} on http://{address}:{actual}/v1 (pid {os.getpid()})",
        flush=True,
    )
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        server.close()
        await runner.cleanup()


# -- JSON lines on stdin/stdout --------------------------------------------------------


async def serve_stdio(host: SessionHost, max_line_bytes: int = protocol.MAX_MESSAGE_BYTES) -> None:
    """Answer one JSON line per request line until stdin closes. Requests carry ``op``,
    ``session`` and ``id``; the answer echoes ``id``. Anything the environment prints goes
    to stderr, so stdout carries only answers."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    sys.stdout = sys.stderr  # stray prints must not corrupt the protocol stream
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=max_line_bytes + 1)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while True:
            try:
                line = await reader.readline()
            except ValueError:
                out.write(protocol.encode(protocol.error("bad_request", "line too long")) + b"\n")
                return
            if not line:
                return
            out.write(await _stdio_answer(host, line, max_line_bytes) + b"\n")
    finally:
        await host.close_all()


async def _stdio_answer(host: SessionHost, line: bytes, max_line_bytes: int) -> bytes:
    try:
        msg = protocol.decode(line, max_line_bytes)
    except protocol.ConnectorError as e:
        return json.dumps(protocol.error("bad_request", str(e))).encode()
    rid = msg.get("id")
    op = msg.get("op")
    try:
        if op == "health":
            answer = host.health()
        else:
            answer = await host.handle(str(op), str(msg.get("session", "")), msg)
    except HostError as e:
        answer = e.body()
    return json.dumps({**answer, "id": rid}).encode()
