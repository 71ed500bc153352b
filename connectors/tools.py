"""Tools the agent calls from its generated text, described by JSON Schema.

The agent writes ``<call>NAME ARGUMENTS</call>``. ARGUMENTS is a JSON object checked
against the tool's schema; for a tool whose schema has exactly one required string
property the bare text may stand for it (``<call>calc 3*(4+5)</call>``). The call runs
with a timeout and its result, or the error, goes back to the agent as a tool
observation: a bad call is the agent's mistake and ends nothing. Arguments are only ever
parsed as JSON; nothing the agent writes is evaluated.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema

from connectors.stats import count
from pipeline.errors import InvalidConfigError

log = logging.getLogger(__name__)

ToolFn = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class Tool:
    """One tool: ``fn(**arguments)`` returns the result (made text with ``str``)."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: ToolFn
    timeout_s: float = 5.0
    max_result_chars: int = 2000

    def describe(self) -> dict[str, Any]:
        """The tool as listed to agents and remote clients (no code, only data)."""
        return {
            "name": self.name,
            "description": self.description,
            "parameters": dict(self.parameters),
        }


class ToolServerError(Exception):
    """The server behind a tool failed (went away, hung, flooded, answered nonsense): not
    the agent's mistake, so not its to read; the episode ends ``env_error`` with this
    reason."""


@dataclass(frozen=True)
class ToolResult:
    """What a call gave back: ``text`` for the agent, ``error`` a stable reason or ""."""

    text: str
    error: str = ""


class ToolRegistry:
    """Tools by name; :meth:`call` parses, validates, runs with a timeout and never
    raises for a bad call (the error is the result). Outcomes are counted as
    ``tool/<name>/<outcome>`` (ok, unknown_tool, bad_arguments, timeout, failed, and
    server_failed: a :class:`ToolServerError`, raised for the episode to end)."""

    def __init__(self, tools: list[Tool] | None = None) -> None:
        self._tools: dict[str, Tool] = {}
        self._validators: dict[str, jsonschema.protocols.Validator] = {}
        for t in tools or []:
            self.add(t)

    def add(self, tool: Tool) -> Tool:
        if not tool.name or any(c.isspace() for c in tool.name):
            raise InvalidConfigError(f"tool name {tool.name!r} must be one word")
        if tool.name in self._tools:
            raise InvalidConfigError(f"tool {tool.name!r} is registered twice")
        if tool.parameters.get("type") != "object":
            raise InvalidConfigError(f"tool {tool.name!r}: parameters must be an object schema")
        try:
            validator = _validator(json.dumps(tool.parameters, sort_keys=True))
        except jsonschema.SchemaError as e:
            raise InvalidConfigError(f"tool {tool.name!r}: bad JSON Schema: {e.message}") from e
        self._tools[tool.name] = tool
        self._validators[tool.name] = validator
        return tool

    def tool(
        self, name: str, description: str, parameters: Mapping[str, Any], timeout_s: float = 5.0
    ) -> Callable[[ToolFn], ToolFn]:
        """Decorator form of :meth:`add`."""

        def deco(fn: ToolFn) -> ToolFn:
            self.add(Tool(name, description, parameters, fn, timeout_s))
            return fn

        return deco

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def describe(self) -> list[dict[str, Any]]:
        return [t.describe() for t in self._tools.values()]

    def parse_arguments(self, name: str, text: str) -> dict[str, Any]:
        """The arguments object of a call to ``name`` from the agent's text; raises
        :class:`ValueError` with a message meant for the agent."""
        tool = self._tools[name]
        text = text.strip()
        if text.startswith("{"):
            try:
                args = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"arguments are not valid JSON: {e.msg}") from None
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
        else:
            single = _single_string_argument(tool.parameters)
            if single is None:
                raise ValueError("arguments must be a JSON object")
            args = {single: text}
        errors = sorted(self._validators[name].iter_errors(args), key=lambda e: list(e.path))
        if errors:
            first = errors[0]
            where = "/".join(str(p) for p in first.path) or "arguments"
            raise ValueError(f"{where}: {first.message}")
        return args

    async def call(self, name: str, text: str) -> ToolResult:
        """Run tool ``name`` on the agent's argument text."""
        tool = self._tools.get(name)
        if tool is None:
            return self._count(name, "unknown_tool", f"error: no tool named {name!r}")
        try:
            args = self.parse_arguments(name, text)
        except ValueError as e:
            return self._count(name, "bad_arguments", f"error: {e}")
        try:
            value = await asyncio.wait_for(tool.fn(**args), tool.timeout_s)
        except TimeoutError:
            return self._count(name, "timeout", f"error: timed out after {tool.timeout_s:g} s")
        except ToolServerError:
            count("tool", f"{name}/server_failed")
            raise
        except Exception as e:  # the tool's failure is reported to the agent, not raised
            log.debug("tool %s failed: %r", name, e)
            return self._count(name, "failed", f"error: {type(e).__name__}: {e}")
        count("tool", f"{name}/ok")
        text_out = str(value)
        if len(text_out) > tool.max_result_chars:
            text_out = text_out[: tool.max_result_chars] + " [truncated]"
        return ToolResult(text_out)

    def _count(self, name: str, reason: str, text: str) -> ToolResult:
        count("tool", f"{name}/{reason}")
        return ToolResult(text, reason)


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> jsonschema.protocols.Validator:
    """A checked validator per distinct schema (environments are made per episode)."""
    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _single_string_argument(schema: Mapping[str, Any]) -> str | None:
    """The one required string property, when that is all a tool takes."""
    required = schema.get("required", [])
    props = schema.get("properties", {})
    if len(required) == 1 and props.get(required[0], {}).get("type") == "string":
        return str(required[0])
    return None
