"""OpenEnv servers as rlstream environments: ``openenv:URL`` (``openenv:http://host:8000``).

A client of OpenEnv's server protocol (the one ``openenv-core``'s ``create_app`` serves):
``GET /health`` and ``GET /schema`` once per process, then one WebSocket session
(``/ws``) per episode, in which the server keeps one environment: ``reset`` (with the
task's seed), ``step`` (the action object), ``state`` and ``close`` messages, each answered
by an ``observation`` (``{"observation": {...}, "reward": ..., "done": ...}``), a
``state`` or an ``error``.

The model's text becomes the action's ``action_field``: by default the one required
string property of the server's action schema (an action schema with no such single
field needs the option). The observation becomes the model's next message: its
``observation_field`` (by default the one text field of the observation, else the
observation as JSON). The reward is the server's (None is 0).

Bounds, as every remote connector has them: connecting, health and schema within
``call_timeout_s``, each message within the episode's step timeout, messages of at most
``max_message_bytes``, no redirects; an error message, a message that is not the
protocol's (not JSON, NaN or an infinite reward, a missing observation) or a dropped
connection ends the episode ``env_error`` with the reason.

OpenEnv's own MCP tool calls (``/mcp``) are not used: an OpenEnv server's tools are added
with ``--tools mcp:URL`` where the server speaks streamable HTTP MCP.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from connectors import protocol
from connectors.base import Environment, SeedTask, Step, Task, shared, topic_safe
from pipeline.errors import InvalidConfigError

#: the fields every OpenEnv observation has besides its own
_COMMON = frozenset({"done", "reward", "metadata"})


class OpenEnvServer:
    """What one server told this event loop: its action schema (for all its episodes),
    and the HTTP session its WebSockets are opened on."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
        )
        self.schema: dict[str, Any] | None = None
        self._lock = asyncio.Lock()

    async def describe(self, timeout_s: float, max_bytes: int) -> dict[str, Any]:
        """The server's ``/schema``, after ``/health`` says it is healthy (once)."""
        async with self._lock:
            if self.schema is None:
                health = await self._get("/health", timeout_s, max_bytes)
                if str(health.get("status", "")).lower() != "healthy":
                    raise protocol.ConnectorError(
                        "unhealthy", f"{self.url}/health says {str(health)[:200]}"
                    )
                self.schema = await self._get("/schema", timeout_s, max_bytes)
            return self.schema

    async def _get(self, path: str, timeout_s: float, max_bytes: int) -> dict[str, Any]:
        try:
            async with asyncio.timeout(timeout_s):
                async with self.session.get(self.url + path, allow_redirects=False) as resp:
                    if resp.status != 200:
                        raise protocol.ConnectorError(
                            "http", f"{self.url}{path} answered {resp.status}"
                        )
                    raw = await resp.content.read(max_bytes + 1)
        except TimeoutError:
            raise TimeoutError(f"{self.url}{path}: no answer in {timeout_s:g} s") from None
        except aiohttp.ClientError as e:
            raise protocol.ConnectorError("connection", f"{self.url}{path}: {e!r}") from None
        return protocol.parse_object(raw, max_bytes)

    async def aclose(self) -> None:
        await self.session.close()


class OpenEnv(Environment):
    def __init__(
        self,
        url: str,
        name: str = "",
        action_field: str = "",
        observation_field: str = "",
        call_timeout_s: float = 30.0,
        max_message_bytes: int = 1 << 20,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidConfigError(f"openenv: {url!r} is not an http(s) URL of a server")
        if not 0 < call_timeout_s <= 3600 or not 1024 <= max_message_bytes <= 1 << 30:
            raise InvalidConfigError(
                "openenv: call_timeout_s must lie in (0, 3600] and max_message_bytes in "
                "[1024, 2**30]"
            )
        self.url = url.rstrip("/")
        # as the rollout topic is named (connectors.base.env_name)
        self.name = name or topic_safe("openenv-" + url)
        self.action_field, self.observation_field = action_field, observation_field
        self.call_timeout_s, self.max_message_bytes = call_timeout_s, max_message_bytes
        self._ws: aiohttp.ClientWebSocketResponse | None = None

    def sample_task(self, rng: Any) -> Task:
        return SeedTask.draw(rng)

    async def reset(self, task: Task) -> str:
        server = shared(("openenv", self.url), lambda: OpenEnvServer(self.url))
        schema = await server.describe(self.call_timeout_s, self.max_message_bytes)
        if not self.action_field:
            self.action_field = _action_field(schema, self.url)
        ws_url = "ws" + self.url[len("http") :] + "/ws"
        try:
            async with asyncio.timeout(self.call_timeout_s):
                self._ws = await server.session.ws_connect(
                    ws_url, max_msg_size=self.max_message_bytes, autoping=True
                )
        except TimeoutError:
            raise TimeoutError(f"{ws_url}: no session in {self.call_timeout_s:g} s") from None
        except aiohttp.ClientError as e:
            raise protocol.ConnectorError("connection", f"{ws_url}: {e!r}") from None
        seed = task.seed if isinstance(task, SeedTask) else None
        answer = await self._exchange({"type": "reset", "data": {"seed": seed}})
        return self._text(answer)

    async def step(self, action: str) -> Step:
        answer = await self._exchange({"type": "step", "data": {self.action_field: action}})
        reward = answer.get("reward")
        if reward is None:
            reward = 0.0
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise protocol.ConnectorError("malformed", f"reward {str(reward)[:60]!r}")
        if not math.isfinite(reward):
            raise protocol.ConnectorError("malformed", f"reward {reward!r}")
        done = answer.get("done", False)
        if not isinstance(done, bool):
            raise protocol.ConnectorError("malformed", f"done {str(done)[:60]!r}")
        return Step(self._text(answer), float(reward), done)

    async def state(self) -> dict[str, Any]:
        """The server's state of this episode's environment (for debugging)."""
        return await self._exchange({"type": "state"}, expect="state")

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is None:
            return
        try:
            if not ws.closed:
                await asyncio.wait_for(ws.send_str(json.dumps({"type": "close"})), 5)
        except (TimeoutError, aiohttp.ClientError, ConnectionError):
            pass
        finally:
            await ws.close()

    async def _exchange(self, message: Mapping[str, Any], expect: str = "observation") -> Any:
        ws = self._ws
        if ws is None or ws.closed:
            raise protocol.ConnectorError("connection", f"{self.url}: no open session")
        await ws.send_str(json.dumps(message, allow_nan=False))
        reply = await ws.receive()  # the episode's step timeout bounds the wait
        if reply.type != aiohttp.WSMsgType.TEXT:
            # closed, failed (a message over max_message_bytes: 1009), or binary
            raise protocol.ConnectorError(
                "connection",
                f"{self.url}: the session ended ({reply.type.name}: {str(reply.data)[:200]})",
            )
        msg = protocol.parse_object(reply.data, self.max_message_bytes)
        kind, data = msg.get("type"), msg.get("data")
        if kind == "error":
            said = data.get("message", data) if isinstance(data, dict) else data
            raise protocol.RemoteError("env_error", f"{self.url}: {str(said)[:300]}")
        if kind != expect or not isinstance(data, dict):
            raise protocol.ConnectorError(
                "malformed", f"{self.url}: a {str(kind)[:40]!r} message where {expect} was due"
            )
        return data

    def _text(self, answer: Mapping[str, Any]) -> str:
        obs = answer.get("observation")
        if not isinstance(obs, dict):
            raise protocol.ConnectorError("malformed", f"{self.url}: no observation object")
        if self.observation_field:
            if self.observation_field not in obs:
                raise protocol.ConnectorError(
                    "malformed", f"{self.url}: no observation field {self.observation_field!r}"
                )
            value = obs[self.observation_field]
            return value if isinstance(value, str) else json.dumps(value)
        texts = [v for k, v in obs.items() if k not in _COMMON and isinstance(v, str)]
        if len(texts) == 1:
            return texts[0]
        return json.dumps({k: v for k, v in obs.items() if k not in _COMMON}, sort_keys=True)


def _action_field(schema: Mapping[str, Any], url: str) -> str:
    """The action schema's one required string property."""
    action = schema.get("action")
    props = action.get("properties", {}) if isinstance(action, dict) else {}
    required = action.get("required", []) if isinstance(action, dict) else []
    if not isinstance(props, dict) or not isinstance(required, list):
        props, required = {}, []
    strings = [
        k
        for k in required
        if isinstance(k, str)
        and isinstance(props.get(k), dict)
        and props[k].get("type") == "string"
    ]
    if len(strings) == 1 and len(required) == 1:
        return strings[0]
    raise InvalidConfigError(
        f"openenv:{url}: its actions have no single required text field (required: "
        f"{str(required)[:200]}); name the one the model's text goes to with "
        "--env-option action_field=NAME"
    )
