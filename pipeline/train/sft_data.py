"""Supervised fine-tuning data: conversations in the usual JSONL chat format, laid out as
rlstream's episodes lay them out, with the loss on the assistant's tokens only.

Each line is one conversation::

    {"messages": [{"role": "system", "content": "..."},
                  {"role": "user", "content": "What is 123 * 456?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function",
                       "function": {"name": "calc", "arguments": {"expr": "123*456"}}}]},
                  {"role": "tool", "content": "56088"},
                  {"role": "assistant", "content": "56088"}],
     "tools": [{"type": "function", "function": {"name": "calc", "description": "...",
                                                 "parameters": {...}}}]}

The tokens are those an episode of the same conversation would hold, so that what SFT
teaches is what the policy sees when RL starts: the opening (system prompt, tools and the
first user message) as the chat template renders it; each assistant turn as the template
writes it after the generation prompt, through its end-of-turn token (tool calls in the
template's own format, e.g. Qwen's ``<tool_call>`` JSON); each tool result or user message
after it as :meth:`~pipeline.policy.chat.ChatTokenizer.turn` appends it, then the
generation prompt. The loss mask covers the assistant turns' tokens (not the generation
prompt). Rendering happens in batches in the template's bounded child process.

A line that is not such a conversation is refused with its line number and the reason.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pipeline.errors import InvalidConfigError
from pipeline.policy.chat import ChatTokenizer
from pipeline.policy.template import Conversation

#: bytes of one line at most (a conversation, not a corpus)
MAX_LINE_BYTES = 1 << 22
#: characters the renderings of one batch may produce (the renderer's bound is 1 MiB)
_RENDER_BATCH_CHARS = 1 << 18
_RENDER_BATCH_CONVERSATIONS = 32


class Example(NamedTuple):
    """One conversation's tokens and its loss mask (1 on assistant tokens)."""

    tokens: np.ndarray
    mask: np.ndarray
    line: int


class Dialogue(NamedTuple):
    line: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]


def _bad(where: str, line: int, why: str) -> InvalidConfigError:
    return InvalidConfigError(f"{where} line {line}: {why}")


def _tool(t: Any) -> dict[str, Any]:
    """A tool as ``{"name", "description", "parameters"}``, from the OpenAI form
    (``{"type": "function", "function": {...}}``) or that form itself."""
    if isinstance(t, dict) and isinstance(t.get("function"), dict):
        t = t["function"]
    if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
        raise ValueError("each tool needs a name (a string)")
    out = {"name": t["name"], "description": t.get("description", "")}
    if not isinstance(out["description"], str):
        raise ValueError(f"tool {t['name']!r}: description must be a string")
    params = t.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ValueError(f"tool {t['name']!r}: parameters must be a JSON schema object")
    out["parameters"] = params
    return out


def _call_ok(call: Any) -> bool:
    fn = call.get("function", call) if isinstance(call, dict) else None
    return (
        isinstance(fn, dict)
        and isinstance(fn.get("name"), str)
        and bool(fn["name"])
        and isinstance(fn.get("arguments", {}), (str, dict))
    )


def _check_messages(messages: Any) -> None:
    """Raises ValueError (the reason) when ``messages`` is not a conversation SFT can
    learn from: roles system (first only), user, assistant, tool; text content; an
    assistant turn, after a user message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list')
    seen_user = seen_assistant = False
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} is not an object")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(
                f"message {i} has role {str(role)[:40]!r} (system, user, assistant, tool)"
            )
        content = m.get("content")
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise ValueError(f"message {i}: only an assistant message has tool_calls")
            if not isinstance(calls, list) or not calls or not all(_call_ok(c) for c in calls):
                raise ValueError(
                    f"message {i}: tool_calls must be a list of "
                    '{"function": {"name": ..., "arguments": ...}}'
                )
        if not isinstance(content, str) and not (content is None and calls):
            raise ValueError(f"message {i} ({role}): content must be text")
        if role == "system" and i:
            raise ValueError(f"message {i}: a system message comes first or not at all")
        if role == "tool" and messages[i - 1].get("role") not in ("assistant", "tool"):
            raise ValueError(f"message {i}: a tool result follows an assistant turn")
        if role == "assistant" and not seen_user:
            raise ValueError(f"message {i}: an assistant turn before any user message")
        seen_user |= role == "user"
        seen_assistant |= role == "assistant"
    if not seen_assistant:
        raise ValueError("no assistant message: nothing to learn")


def read_conversations(path: Path) -> list[Dialogue]:
    """Every conversation of the JSONL file ``path`` (blank lines skipped);
    InvalidConfigError naming the first malformed line and why."""
    if not path.is_file():
        raise InvalidConfigError(f"{path} is not a file of conversations (JSONL)")
    out = []
    with path.open("rb") as f:
        for n, raw in enumerate(_lines(f, path), 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (ValueError, RecursionError):
                raise _bad(str(path), n, "is not JSON") from None
            if not isinstance(obj, dict):
                raise _bad(str(path), n, 'is not an object with "messages"')
            try:
                _check_messages(obj.get("messages"))
                tools = obj.get("tools") or []
                if not isinstance(tools, list):
                    raise ValueError('"tools" must be a list')
                listed = [_tool(t) for t in tools]
            except ValueError as e:
                raise _bad(str(path), n, str(e)) from None
            out.append(Dialogue(n, obj["messages"], listed))
    if not out:
        raise InvalidConfigError(f"{path} holds no conversation")
    return out


def _lines(f: Any, path: Path) -> Iterator[bytes]:
    n = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        n += 1
        if len(raw) > MAX_LINE_BYTES:
            raise _bad(str(path), n, f"is longer than {MAX_LINE_BYTES} bytes")
        yield raw


def _renderings(c: Dialogue) -> list[Conversation]:
    """What :func:`layout` needs rendered: for each assistant turn, the conversation
    before it with the generation prompt and the conversation through it."""
    out: list[Conversation] = []
    for i, m in enumerate(c.messages):
        if m["role"] == "assistant":
            out += [(c.messages[:i], True), (c.messages[: i + 1], False)]
    return out


def _batches(convs: Sequence[Dialogue]) -> Iterator[list[Dialogue]]:
    """Conversations with the same tools, a few at a time (one rendering call each)."""
    by_tools: dict[str, list[Dialogue]] = {}
    for c in convs:
        by_tools.setdefault(json.dumps(c.tools, sort_keys=True, default=str), []).append(c)
    for group in by_tools.values():
        batch: list[Dialogue] = []
        chars = 0
        for c in group:
            size = len(json.dumps(c.messages, default=str)) * len(_renderings(c))
            if batch and (
                chars + size > _RENDER_BATCH_CHARS or len(batch) >= _RENDER_BATCH_CONVERSATIONS
            ):
                yield batch
                batch, chars = [], 0
            batch.append(c)
            chars += size
        if batch:
            yield batch


def layout(chat: ChatTokenizer, c: Dialogue, rendered: Sequence[str], where: str) -> Example:
    """The tokens and loss mask of conversation ``c`` from its :func:`_renderings`; a
    message that holds a special token's text is refused (it would be read as the token:
    a turn ended or begun inside a message)."""
    for i, m in enumerate(c.messages):
        texts = [m.get("content") or "", json.dumps(m.get("tool_calls") or [])]
        hit = next((s for s in chat.special_texts for t in texts if s in t), None)
        if hit is not None:
            raise _bad(
                where,
                c.line,
                f"message {i} holds {hit!r}, the text of a special token of the chat format",
            )
    stops = [chat.decode([i], specials=True) for i in chat.stop_tokens]
    tokens: list[int] = []
    mask: list[int] = []

    def add(ids: list[int], learn: bool) -> None:
        tokens.extend(ids)
        mask.extend([int(learn)] * len(ids))

    k = 0
    for i, m in enumerate(c.messages):
        if m["role"] != "assistant":
            continue
        before, through = rendered[k], rendered[k + 1]
        k += 2
        if not tokens:  # the opening: as an episode opens when it can
            first = c.messages[:i]
            if len(first) == 1:
                add(chat.opening(first[0]["content"], c.tools) + chat.assistant_header, False)
            else:
                add(chat.encode(before), False)
        else:
            prev = i - 1
            while c.messages[prev]["role"] != "assistant":
                prev -= 1
            for between in c.messages[prev + 1 : i]:
                add(chat.turn(between["role"], between["content"] or ""), False)
            add(chat.assistant_header, False)
        if not through.startswith(before):
            raise _bad(
                where,
                c.line,
                f"the chat template rewrites the conversation when message {i} follows",
            )
        ends = [at for s in stops if (at := through.find(s, len(before))) >= 0]
        if not ends:
            raise _bad(
                where,
                c.line,
                f"the chat template does not end message {i} with an end-of-turn token",
            )
        end = min(ends)
        end += next(len(s) for s in stops if through.startswith(s, end))
        reply = chat.encode(through[len(before) : end])
        if not reply or reply[-1] not in chat.stop_tokens:
            raise _bad(
                where,
                c.line,
                f"message {i} does not tokenize to a turn ending in the end-of-turn token",
            )
        add(reply, True)
    return Example(np.asarray(tokens, np.int32), np.asarray(mask, np.float32), c.line)


def load_examples(
    path: Path,
    chat: ChatTokenizer,
    max_tokens: int,
    progress: Callable[[str], None] = lambda s: None,
) -> list[Example]:
    """Every conversation of ``path`` as tokens and loss mask; one longer than
    ``max_tokens`` is refused with its line number."""
    convs = read_conversations(path)
    out: list[Example] = []
    shown = time.monotonic()
    for batch in _batches(convs):
        each = [_renderings(c) for c in batch]
        wanted = [r for rs in each for r in rs]
        try:
            rendered = chat.render_many(wanted, batch[0].tools)
        except InvalidConfigError as e:
            lines = f"{batch[0].line}-{batch[-1].line}"
            raise InvalidConfigError(f"{path} lines {lines}: {e}") from None
        k = 0
        for c, rs in zip(batch, each, strict=True):
            n = len(rs)
            ex = layout(chat, c, rendered[k : k + n], str(path))
            k += n
            if len(ex.tokens) > max_tokens:
                raise _bad(
                    str(path),
                    c.line,
                    f"{len(ex.tokens)} tokens, more than the {max_tokens} of a packed row "
                    "(raise --length, up to the model's max_len, or shorten it)",
                )
            out.append(ex)
        if time.monotonic() - shown > 2 or len(out) == len(convs):
            shown = time.monotonic()
            progress(f"tokenized {len(out)}/{len(convs)} conversations")
    return out
