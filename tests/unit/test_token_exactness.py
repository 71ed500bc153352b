"""Multi-turn token exactness: the tokens an episode appends piece by piece are those of
the conversation rendered at once by the chat template and tokenized (what
``apply_chat_template`` gives, shown equal to transformers' own in test_hf_models), over
10,002 fuzzed conversations of the shipped templates (ChatML for Qwen2 and Qwen3, Llama
3's); and the producer's check (:mod:`pipeline.rollout.exactness`) calls a record exact
exactly when that rendering agrees, including the turns a template rewrites."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.policy.chat import ChatTokenizer
from pipeline.policy.hf_init import init_checkpoint
from pipeline.policy.server import TurnResult
from pipeline.policy.template import compile_template
from pipeline.policy.tokenizer import ByteTokenizer
from pipeline.rollout.episode import _Recorder
from pipeline.rollout.exactness import Exactness, check

FAMILIES = ("llama", "qwen2", "qwen3")
#: conversations per family: 10,002 in all
PER_FAMILY = 3334
#: what fuzzed texts are made of: words, whitespace of every kind, non-ASCII, JSON and
#: template syntax, the tool-call and tool-response markers, and the texts of the
#: formats' special tokens (read as those tokens, by both sides)
PARTS = [
    "hello", " world", "12", "3.5", "\n", "\n\n", "  ", "\t", "\r\n", "é", "中文", "🙂",
    "a\u0301", "\u00a0", "{", "}", '"x"', "\\n", "'", "<tool_call>", "</tool_call>",
    "<tool_response>", "{{ x }}", "{% if %}", "<|", "|>", "<|im_end|>", "<|im_start|>",
    "<|endoftext|>", "<|eot_id|>", "<|start_header_id|>",
]  # fmt: skip
CHARS = "abcdefghijklmnopqrstuvwxyzABC0123456789 .,:;!?+-*/=()[]"


@pytest.fixture(scope="module")
def formats(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ChatTokenizer]:
    root = tmp_path_factory.mktemp("exact")
    return {f: ChatTokenizer.load(init_checkpoint(root / f, f, "tiny", seed=0)) for f in FAMILIES}


def text(r: random.Random, most: int) -> str:
    return "".join(
        r.choice(PARTS) if r.random() < 0.5 else r.choice(CHARS) for _ in range(r.randint(0, most))
    )


def reply(r: random.Random, tok: ChatTokenizer, family: str) -> str:
    """A policy turn's text: prose, or a tool call in the format's own syntax; never a
    stop token's text (sampling ends at the first stop token)."""
    if r.random() < 0.4:
        args = json.dumps({"x": text(r, 6)})
        if family == "llama":
            out = '{"name": "calc", "parameters": ' + args + "}"
        else:
            out = '<tool_call>\n{"name": "calc", "arguments": ' + args + "}\n</tool_call>"
    else:
        out = text(r, 12)
    for stop in tok.stop_tokens:
        out = out.replace(tok.decode([stop], specials=True), "")
    return out


class Fuzzed:
    """One conversation built as an episode builds it (pieces appended to a record), and
    its messages, to be rendered at once."""

    def __init__(self, tok: ChatTokenizer, prompt: str, tools: list[dict[str, Any]]) -> None:
        self.tok, self.tools = tok, tools
        self.rec = _Recorder(max_observation_tokens=1 << 30)
        self.rec.context("user", tok.opening(prompt, tools))
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]

    def policy(self, content: str, sampled: list[int]) -> None:
        result = TurnResult(sampled, [-1.0] * len(sampled), [0] * len(sampled))
        self.rec.policy(self.tok.assistant_header, result, 0.0)
        self.messages.append({"role": "assistant", "content": content})

    def context(self, role: str, content: str) -> None:
        self.rec.context(role, self.tok.turn(role, content))
        self.messages.append({"role": "tool" if role == "tool" else "user", "content": content})

    def at_once(self, template: Any, prompted: bool) -> list[int]:
        listed = [{"type": "function", "function": t} for t in self.tools] or None
        return self.tok.encode(
            template.render(
                messages=self.messages,
                tools=listed,
                add_generation_prompt=prompted,
                **self.tok.specials,
            )
        )

    def record(self) -> tuple[np.ndarray, np.ndarray, list[Any]]:
        return np.array(self.rec.tokens), np.array(self.rec.mask), self.rec.turns


def end_token(tok: ChatTokenizer, family: str) -> int:
    (end,) = tok.encode("<|eot_id|>" if family == "llama" else "<|im_end|>")
    return end


@pytest.mark.parametrize("family", FAMILIES)
def test_pieces_are_the_conversation_rendered_at_once(
    family: str, formats: dict[str, ChatTokenizer]
) -> None:
    """Fuzzed prompts, tool lists, tool results and observations (any whitespace, any
    markup); policy turns as the template writes them (its end-of-turn token, text it
    does not trim, their own tokenization): appended piece by piece, exactly the
    tokens of the whole conversation rendered at once, and the check agrees."""
    tok = formats[family]
    template = compile_template(tok.template_source)
    end = end_token(tok, family)
    r = random.Random(f"exact-{family}")
    toolsets: list[list[dict[str, Any]]] = [[]]
    for _ in range(5):
        toolsets.append(
            [
                {
                    "name": f"tool{k}",
                    "description": text(r, 8),
                    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
                }
                for k in range(r.randint(1, 3))
            ]
        )
    exact = Exactness()
    for _ in range(PER_FAMILY):
        c = Fuzzed(tok, text(r, 16), r.choice(toolsets))
        for _ in range(r.randint(1, 5)):
            content = reply(r, tok, family)
            if family == "llama":
                content = content.strip()  # (its template trims: see the next test)
            c.policy(content, [*tok.encode(content), end])
            c.context("tool" if r.random() < 0.5 else "environment", text(r, 12))
        prompted = r.random() < 0.5
        if prompted:
            c.rec.context("user", tok.assistant_header)  # (as the next turn's feed)
        assert c.rec.tokens == c.at_once(template, prompted), c.messages
        exact.add(tok, *c.record())
    assert (exact.checked, exact.rewritten_turns, exact.divergent_context) == (PER_FAMILY, 0, 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_check_finds_exactly_the_turns_a_template_rewrites(
    family: str, formats: dict[str, ChatTokenizer]
) -> None:
    """Policy turns as a policy may sample them: stopped by another stop token or not at
    all, text with the whitespace Llama 3's template trims, tokens that are not the
    tokenization of their text (a token spelled out as smaller ones). Rendering such a
    conversation at once gives other tokens than the record's (the trainer scores the
    record's, those sampled); the check counts a conversation's rewritten turns exactly
    when the rendering differs."""
    tok = formats[family]
    template = compile_template(tok.template_source)
    end = end_token(tok, family)
    others = sorted(tok.stop_tokens - {end})
    r = random.Random(f"rewrites-{family}")
    rewritten_conversations = 0
    for _ in range(400):
        c = Fuzzed(tok, text(r, 8), [])
        for _ in range(r.randint(1, 3)):
            content = reply(r, tok, family)
            sampled = tok.encode(content)
            kind = r.choice(["exact", "stop", "none", "pad", "split"])
            if family == "llama":
                content = content.strip() if kind != "pad" else " " + content.strip() + "\n"
                sampled = tok.encode(content)
            stop = end
            if kind == "stop" and others:
                stop = r.choice(others)
            if kind == "split":  # one token of several characters as one token per character
                at = next((i for i, t in enumerate(sampled) if len(tok.decode([t])) > 1), None)
                if at is not None:
                    piece = tok.decode([sampled[at]])
                    sampled[at : at + 1] = [t for ch in piece for t in tok.encode(ch)]
            c.policy(content, sampled if kind == "none" else [*sampled, stop])
            c.context("tool" if r.random() < 0.5 else "environment", text(r, 8))
        rewritten, diverges = check(tok, *c.record())
        differs = c.rec.tokens != c.at_once(template, False)
        assert (rewritten > 0 or diverges) == differs, c.messages
        assert not diverges
        rewritten_conversations += rewritten > 0
    assert rewritten_conversations > 100  # the fuzz reaches them


def test_the_byte_format_counts_bytes_that_are_not_text() -> None:
    """The built-in byte format has no template: a policy turn is rewritten only where
    its bytes are not UTF-8 (its text holds U+FFFD instead)."""
    tok = ByteTokenizer()
    c = _Recorder(1 << 30)
    c.context("user", tok.opening("hi"))
    for sampled in ([*b"fine", tok.eos], [0xC3, 0xA9, tok.eos], [0xFF, 0x41, tok.eos]):
        c.policy(tok.assistant_header, TurnResult(sampled, [0.0] * 3, [0] * 3), 0.0)
        c.context("environment", tok.turn("environment", "ok"))
    assert check(tok, np.array(c.tokens), np.array(c.mask), c.turns) == (1, False)


def test_a_template_that_rewrites_replies_beyond_trimming_still_loads(tmp_path: Path) -> None:
    """A template that writes the policy's replies in its own way (here: upper case) is
    not refused for it, since episodes never render a reply. Its rewrite is beyond what
    the check can see (it knows only trimming and the end token): its turns are checked
    for their tokenization alone."""
    d = init_checkpoint(tmp_path / "up", "qwen2", "tiny", seed=0)
    jinja = d / "chat_template.jinja"
    source = jinja.read_text()
    assert "(message.content or '')" in source
    jinja.write_text(source.replace("(message.content or '')", "(message.content or '') | upper"))
    tok = ChatTokenizer.load(d)
    end = end_token(tok, "qwen2")
    c = Fuzzed(tok, "hi", [])
    c.policy("abc", [*tok.encode("abc"), end])
    he = tok.encode("he")
    assert len(he) == 1  # one token, spelled out below as two
    c.policy("he", [*tok.encode("h"), *tok.encode("e"), end])
    c.context("tool", "1")
    assert "ABC" in tok.decode(c.at_once(compile_template(tok.template_source), False))
    assert check(tok, *c.record()) == (1, False)
