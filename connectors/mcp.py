"""The tools of an MCP server for any environment's episodes: ``--tools mcp:COMMAND`` (a
server started as a child process, spoken to over its stdin and stdout) or
``--tools mcp:URL`` (a server at an http(s) address, streamable HTTP).

One connection per server and event loop serves every episode of a process (the client
of the ``mcp`` SDK, entered and left by one task that owns it). The server's tools are
listed once, with their JSON schemas, and added to each episode's environment; the
model's calls are validated against those schemas (:class:`~connectors.tools.ToolRegistry`)
and run through the client.

Bounds, as every remote connector has them: connecting and listing within
``connect_timeout_s``, at most ``max_tools`` tools each with a schema of at most 64 KiB,
every call within ``call_timeout_s``, a result of at most ``max_result_chars`` (longer
ones are cut for the model) and never more than ``max_answer_chars`` (such a server is
flooding). A tool that reports an error (``isError``) is the model's to read; a server
that dies, hangs, floods or answers what is not MCP ends the episode ``env_error`` with
the reason (:class:`~connectors.tools.ToolServerError`), and the next episode connects
again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from connectors.tools import Tool, ToolServerError
from pipeline.errors import InvalidConfigError

log = logging.getLogger(__name__)

#: what a --tools value names: mcp:COMMAND or mcp:URL
PREFIX = "mcp:"
_MAX_SCHEMA_BYTES = 64 * 1024


def check_spec(spec: str) -> str:
    """``spec`` if it names an MCP server rlstream can reach; InvalidConfigError if not."""
    if not isinstance(spec, str) or not spec.startswith(PREFIX) or not spec[len(PREFIX) :].strip():
        raise InvalidConfigError(
            f"tools {spec!r}: name an MCP server as mcp:COMMAND (stdio) or mcp:URL (http)"
        )
    target = spec[len(PREFIX) :].strip()
    if not target.startswith(("http://", "https://")):
        try:
            argv = shlex.split(target)
        except ValueError as e:
            raise InvalidConfigError(f"tools {spec!r}: the command does not parse: {e}") from None
        if not argv:
            raise InvalidConfigError(f"tools {spec!r}: no command")
    return spec


class McpServer:
    """One MCP server's tools for every episode of an event loop (made through
    :func:`connectors.base.shared`, closed with the loop's other shared resources)."""

    def __init__(
        self,
        spec: str,
        *,
        connect_timeout_s: float = 30.0,
        call_timeout_s: float = 10.0,
        max_tools: int = 128,
        max_result_chars: int = 4000,
        max_answer_chars: int = 1 << 20,
    ) -> None:
        self.spec = check_spec(spec)
        self.connect_timeout_s, self.call_timeout_s = connect_timeout_s, call_timeout_s
        self.max_tools, self.max_result_chars = max_tools, max_result_chars
        self.max_answer_chars = max_answer_chars
        self._client: Any = None
        self._tools: list[Tool] | None = None
        self._ready: asyncio.Future[None] | None = None
        self._closing: asyncio.Event | None = None
        self._owner: asyncio.Task[None] | None = None
        self._errlog: Any = None
        self.gone: str = ""  # why the connection ended, once it has

    # -- the connection -------------------------------------------------------------------

    def _transport(self) -> Any:
        from mcp.client.stdio import StdioServerParameters, stdio_client

        target = self.spec[len(PREFIX) :].strip()
        if target.startswith(("http://", "https://")):
            return target
        argv = shlex.split(target)
        params = StdioServerParameters(command=argv[0], args=argv[1:], cwd=os.getcwd())
        # the server's own log is not the producer's: it goes nowhere
        self._errlog = open(os.devnull, "w")
        return stdio_client(params, errlog=self._errlog)

    async def _own(self) -> None:
        """The task that enters the client, lists the tools and holds the connection
        until it is closed or the server goes."""
        from mcp import Client

        assert self._ready is not None and self._closing is not None
        try:
            async with Client(self._transport(), cache=None, mode="legacy") as client:
                listed = await client.list_tools()
                self._tools = self._adopt(listed.tools)
                self._client = client
                self._ready.set_result(None)
                await self._closing.wait()
        except BaseException as e:  # the server went (or never came): say why, once
            self.gone = self.gone or _reason(e)
            if not self._ready.done():
                self._ready.set_exception(ToolServerError(f"{self._name()}: {self.gone}"))
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            self._client = None
            if not self.gone:
                self.gone = "closed"

    async def connect(self) -> list[Tool]:
        """The server's tools (connecting on first use); ToolServerError if it cannot
        be reached, does not answer in time or lists what rlstream refuses."""
        if self._ready is None:
            self._ready = asyncio.get_running_loop().create_future()
            self._closing = asyncio.Event()
            self._owner = asyncio.ensure_future(self._own())
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), self.connect_timeout_s)
        except TimeoutError:
            self.gone = f"no answer to connecting and listing tools in {self.connect_timeout_s:g} s"
            self._ready.cancel()  # nobody waits for it any more
            await self.aclose(wait_s=0)
            raise ToolServerError(f"{self._name()}: {self.gone}") from None
        if self.gone or self._tools is None:
            raise ToolServerError(f"{self._name()}: {self.gone or 'not connected'}")
        return list(self._tools)

    async def aclose(self, wait_s: float = 10.0) -> None:
        """Leave the connection (the server's process ends with it), waiting ``wait_s``
        for it to close in order before it is cancelled."""
        if self._closing is not None:
            self._closing.set()
        if self._owner is not None and not self._owner.done():
            done, _ = await asyncio.wait({self._owner}, timeout=wait_s)
            if not done:
                self._owner.cancel()
                await asyncio.wait({self._owner}, timeout=5)
        if self._errlog is not None:
            self._errlog.close()
            self._errlog = None

    def _name(self) -> str:
        return f"MCP server {self.spec[len(PREFIX) :][:120]!r}"

    # -- tools ----------------------------------------------------------------------------

    def _adopt(self, listed: Sequence[Any]) -> list[Tool]:
        if len(listed) > self.max_tools:
            raise ToolServerError(f"lists {len(listed)} tools, more than {self.max_tools}")
        out = []
        for t in listed:
            name = getattr(t, "name", None)
            schema = getattr(t, "input_schema", None) or getattr(t, "inputSchema", None)
            if not isinstance(name, str) or not name or any(c.isspace() for c in name):
                raise ToolServerError(f"lists a tool named {str(name)[:60]!r}")
            if not isinstance(schema, Mapping) or schema.get("type") != "object":
                raise ToolServerError(f"tool {name!r} takes no JSON object schema")
            if len(json.dumps(schema)) > _MAX_SCHEMA_BYTES:
                raise ToolServerError(f"tool {name!r} has a schema over {_MAX_SCHEMA_BYTES} bytes")
            description = str(getattr(t, "description", "") or "")[:2000]
            out.append(
                Tool(
                    name,
                    description,
                    dict(schema),
                    _Call(self, name),
                    # the registry's own timeout is a backstop: the call's is ours
                    timeout_s=self.call_timeout_s + 5,
                    max_result_chars=self.max_result_chars,
                )
            )
        return out

    async def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """The text of tool ``name``'s result (an error the tool reports included, for
        the model to read); ToolServerError when the server fails rather than the tool."""
        client = self._client
        if client is None:
            raise ToolServerError(f"{self._name()}: {self.gone or 'not connected'}")
        try:
            result = await asyncio.wait_for(
                client.call_tool(name, dict(arguments)), self.call_timeout_s
            )
        except TimeoutError:
            raise ToolServerError(
                f"{self._name()}: tool {name!r} did not answer in {self.call_timeout_s:g} s"
            ) from None
        except Exception as e:  # the connection failed: the next episode makes a new one
            self.gone = self.gone or _reason(e)
            if self._closing is not None:
                self._closing.set()
            raise ToolServerError(f"{self._name()}: tool {name!r}: {_reason(e)}") from None
        text = _text(result, self.max_answer_chars)
        if text is None:
            raise ToolServerError(
                f"{self._name()}: tool {name!r} answered more than {self.max_answer_chars} "
                "characters"
            )
        return ("error: " + text) if getattr(result, "is_error", False) else text


class _Call:
    """A tool's function: ``fn(**arguments)`` calls it on the server."""

    def __init__(self, server: McpServer, name: str) -> None:
        self.server, self.name = server, name

    async def __call__(self, **arguments: Any) -> str:
        return await self.server.call(self.name, arguments)


def _text(result: Any, limit: int) -> str | None:
    """The result's content as text (text parts as they are, others by their kind), or
    None past ``limit`` characters."""
    parts, total = [], 0
    for block in getattr(result, "content", None) or []:
        kind = getattr(block, "type", "")
        piece = block.text if kind == "text" else f"[{kind or 'unknown'} content]"
        total += len(piece)
        if total > limit:
            return None
        parts.append(piece)
    if not parts:
        structured = getattr(result, "structured_content", None)
        if structured is not None:
            piece = json.dumps(structured, default=str)
            return None if len(piece) > limit else piece
    return "\n".join(parts)


def _reason(e: BaseException) -> str:
    """One line of why: nested exception groups (anyio's) unwrapped to their first."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


async def list_tools(specs: Sequence[str]) -> list[dict[str, Any]]:
    """What ``rlstream env tools`` prints: each server's tools with their schemas."""
    out: list[dict[str, Any]] = []
    for spec in specs:
        server = McpServer(spec)
        try:
            tools = await server.connect()
        finally:
            await server.aclose()
        out.extend({"server": spec, **t.describe()} for t in tools)
    return out
