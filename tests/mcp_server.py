"""An MCP server made with the ``mcp`` SDK's own server class, for rlstream's tests:
``python -m tests.mcp_server [stdio | http PORT]``. Besides honest tools it has tools
that misbehave the ways a real server can: hang, flood, die."""

from __future__ import annotations

import asyncio
import os
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("rlstream-test-tools")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def shout(text: str) -> str:
    """The text in capitals."""
    return text.upper()


@server.tool()
async def hang(seconds: float) -> str:
    """Answer after ``seconds``."""
    await asyncio.sleep(seconds)
    return "woke"


@server.tool()
def flood(chars: int) -> str:
    """``chars`` characters of text."""
    return "x" * chars


@server.tool()
def fail(reason: str) -> str:
    """Raise with ``reason``."""
    raise ValueError(reason)


@server.tool()
def die() -> str:
    """End the server's process at once."""
    os._exit(3)


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
