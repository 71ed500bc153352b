"""The ``http`` connector: an environment served elsewhere over the remote protocol
(``rlstream env serve NAME --port P``, or any server of docs/environment-protocol.md).

``--env http --env-option url=http://host:port --env-option name=guess``

All the episodes of a producer share one connection pool per server. Each call has its
own timeout; calls that fail on the way (connection refused or reset, a timeout, 502,
503, 504, 429, a 500 that is not the environment's own error) are repeated with
exponential back-off up to ``attempts`` times, which is safe because every call of the
protocol is idempotent. A malformed or oversized answer, or the environment's own error,
is not repeated: the episode ends with ``env_error`` (``timeout`` when the server never
answered). Redirects are never followed (a 3xx answer is ``redirect``, an
``env_error``): actions go to the configured server and nowhere else. Outcomes are
counted in :mod:`connectors.stats` as ``http/<reason>``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)

from connectors import protocol
from connectors.base import Environment, SeedTask, Step, Task, shared
from connectors.stats import count
from pipeline.errors import InvalidConfigError

log = logging.getLogger(__name__)


class _Transient(Exception):
    """A failure on the way that a repeated call may not meet."""

    def __init__(self, reason: str, message: str, timeout: bool = False) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.timeout = reason, timeout


class HttpPool:
    """One aiohttp session (keep-alive connection pool) for all episodes on one loop."""

    def __init__(self, url: str, pool_size: int) -> None:
        self.url = url.rstrip("/") + "/v1"
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=pool_size),
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,  # a compressed body could expand past the size bound
        )

    async def aclose(self) -> None:
        await self.session.close()


class HttpEnvironment(Environment):
    """A remote environment; ``name`` is the one its trajectories carry (and the rollout
    topic's), by default ``http``."""

    name = "http"  # (the ``name`` option overrides it)

    def __init__(
        self,
        url: str,
        name: str = "http",
        call_timeout_s: float = 5.0,
        attempts: int = 3,
        backoff_s: float = 0.2,
        max_response_bytes: int = protocol.MAX_MESSAGE_BYTES,
        pool_size: int = 64,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidConfigError(f"environment url {url!r} is not http(s)://host:port")
        if attempts < 1 or call_timeout_s <= 0:
            raise InvalidConfigError("attempts must be at least 1 and call_timeout_s positive")
        self.url, self.name = url, name
        self.call_timeout_s, self.attempts, self.backoff_s = call_timeout_s, attempts, backoff_s
        self.max_response_bytes, self.pool_size = max_response_bytes, pool_size
        self._sid = ""
        self._seq = 0

    def sample_task(self, rng: random.Random) -> Task:
        return SeedTask.draw(rng)

    async def reset(self, task: Task) -> str:
        self._sid, self._seq = uuid.uuid4().hex, 0
        msg = await self._call("PUT", f"/sessions/{self._sid}", protocol.task_message(task))
        return protocol.text(msg, "observation")

    async def step(self, action: str) -> Step:
        self._seq += 1
        body = {"seq": self._seq, "action": action}
        return protocol.step_of(await self._call("POST", f"/sessions/{self._sid}/step", body))

    async def call_tool(self, name: str, arguments: str) -> str:
        self._seq += 1
        body = {"seq": self._seq, "name": name, "arguments": arguments}
        try:
            msg = await self._call("POST", f"/sessions/{self._sid}/tool", body)
        except protocol.RemoteError as e:
            if e.code == "no_such_tool":
                raise KeyError(name) from None
            raise
        return protocol.text(msg, "result")

    async def close(self) -> None:
        if self._sid:
            sid, self._sid = self._sid, ""
            await self._call("DELETE", f"/sessions/{sid}", None)

    async def health(self) -> dict[str, Any]:
        return await self._call("GET", "/health", None)

    async def _call(self, method: str, path: str, body: Mapping[str, Any] | None) -> dict[str, Any]:
        key = ("http", self.url, self.pool_size)
        pool = shared(key, lambda: HttpPool(self.url, self.pool_size))
        data = protocol.encode(body) if body is not None else None
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(self.attempts),
                wait=wait_random_exponential(multiplier=self.backoff_s, max=2.0),
                retry=retry_if_exception_type(_Transient),
                reraise=True,
            ):
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        count("http", "retry")
                    return await self._once(pool, method, path, data)
        except _Transient as e:
            count("http", "gave_up")
            if e.timeout:
                raise TimeoutError(f"{self.url}{path}: {e}") from None
            raise protocol.ConnectorError(e.reason, f"{self.url}{path}: {e}") from None
        raise AssertionError("unreachable")

    async def _once(
        self, pool: HttpPool, method: str, path: str, data: bytes | None
    ) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"} if data is not None else None
        try:
            async with asyncio.timeout(self.call_timeout_s):
                async with pool.session.request(
                    method, pool.url + path, data=data, headers=headers, allow_redirects=False
                ) as resp:
                    status = resp.status
                    if 300 <= status < 400:  # the configured server only: never followed
                        where = resp.headers.get("Location", "")[:200]
                        raise protocol.ConnectorError(
                            "redirect", f"answered {status} to {where!r}; redirects are refused"
                        )
                    raw = await self._read(resp)
        except TimeoutError:
            count("http", "timeout")
            raise _Transient("timeout", f"no answer in {self.call_timeout_s:g} s", True) from None
        except aiohttp.ClientError as e:
            count("http", "connection")
            raise _Transient("connection", repr(e)) from None
        except protocol.ConnectorError as e:
            count("http", e.reason)
            raise
        try:
            msg = protocol.decode(raw, self.max_response_bytes)
        except protocol.ConnectorError as e:
            if status >= 500:  # e.g. a proxy's error page: the server may come back
                count("http", f"http_{status}")
                raise _Transient(f"http_{status}", str(e)) from None
            count("http", e.reason)
            raise
        if (status == 429 or status >= 500) and _code(msg) not in ("env_error", "env_timeout"):
            count("http", f"http_{status}")
            raise _Transient(f"http_{status}", str(msg.get("error", ""))[:200])
        try:
            protocol.raise_if_error(msg, status)
        except protocol.RemoteError as e:
            count("http", e.code if e.code in _KNOWN_CODES else "remote_error")
            if e.code == "env_timeout":
                raise TimeoutError(str(e)) from None
            raise
        return msg

    async def _read(self, resp: aiohttp.ClientResponse) -> bytes:
        """The body, refusing more than ``max_response_bytes`` without reading it all."""
        limit = self.max_response_bytes
        if resp.content_length is not None and resp.content_length > limit:
            raise protocol.ConnectorError(
                "oversized", f"answer of {resp.content_length} bytes (limit {limit})"
            )
        chunks, size = [], 0
        async for chunk in resp.content.iter_chunked(64 * 1024):
            size += len(chunk)
            if size > limit:
                raise protocol.ConnectorError("oversized", f"answer over {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)


_KNOWN_CODES = frozenset(
    {"env_error", "env_timeout", "no_session", "no_such_tool", "conflict", "bad_request"}
)


def _code(msg: Mapping[str, Any]) -> str:
    err = msg.get("error")
    return str(err.get("code", "")) if isinstance(err, dict) else ""
