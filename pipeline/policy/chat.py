"""A Hugging Face checkpoint's own tokenizer and chat template, token in and token out.

The tokenizer is ``tokenizer.json`` read by the ``tokenizers`` library; the chat template
comes from ``tokenizer_config.json`` or ``chat_template.jinja`` (where transformers 5 keeps
it) and is rendered with Jinja2 the way transformers renders it, within bounds of time,
memory and output, in a child process (:mod:`pipeline.policy.template`).

An episode never re-tokenizes its history, and never renders the template. Each piece it
appends is the template's text for that piece alone, found once at load by rendering a
fixed conversation with and without it, and each kind of message with a placeholder for
its text (which the template may pass through or trim, nothing else):

- the opening: the whole rendering of ``[user prompt]`` (system prompt, begin token);
- the policy's header: what ``add_generation_prompt`` adds;
- a tool result or an observation: what rendering one more message adds after the end
  of the policy's turn (so the separator the template writes after the end-of-turn token,
  such as ChatML's newline, is appended as context, not sampled).

:meth:`ChatTokenizer.load` checks that the template is prefix-stable (a longer
conversation's rendering begins with a shorter one's) and refuses one that is not; the
tests show, for each template rlstream ships, that the appended pieces are the tokens of
the whole conversation rendered at once.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tokenizers import Tokenizer

from pipeline.errors import InvalidConfigError
from pipeline.policy.hf_format import load_json, load_tokenizer
from pipeline.policy.template import Conversation, render_bounded

_PROBE_USER, _PROBE_REPLY = "U", "X"
#: the text a message's content is rendered as once, at load, to find where an episode's
#: own text goes (a template may only pass it through or trim it)
_SLOT = "\x00rlstream-content\x00"
_PADDED = " \n" + _SLOT + "\n "


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTokenizer:
    """The tokenizer and chat template of a Hugging Face checkpoint directory."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: str,
        specials: dict[str, str],
        eos_ids: Sequence[int],
        digest: str,
    ) -> None:
        self.tok = tokenizer
        self.template_source = template
        self.specials = specials
        self.id = digest
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.stop_tokens = set(eos_ids)
        if not self.stop_tokens:
            raise InvalidConfigError("the tokenizer names no end-of-turn token (eos_token)")
        #: ids of the tool-call markers, when the vocabulary has them as single tokens
        self.call = tokenizer.token_to_id("<tool_call>")
        self._openings: dict[str, _Piece] = {}  # by the JSON of the tools they list
        self.end_call = tokenizer.token_to_id("</tool_call>")
        self._probe()

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def load(cls, directory: Path) -> ChatTokenizer:
        """The tokenizer of ``directory``; InvalidConfigError (one sentence) when it has
        none, no chat template, or a template rlstream cannot append to."""
        tj = directory / "tokenizer.json"
        if not tj.is_file():
            raise InvalidConfigError(f"{directory} has no tokenizer.json")
        tokenizer = load_tokenizer(tj)
        cfg_file = directory / "tokenizer_config.json"
        config = load_json(cfg_file, "tokenizer configuration") if cfg_file.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja = directory / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8", errors="replace")
        if not isinstance(template, str) or not template.strip():
            raise InvalidConfigError(
                f"{directory} has no chat template (tokenizer_config.json chat_template or "
                "chat_template.jinja): rlstream cannot lay out a conversation without one"
            )
        specials = {
            k: v
            for k in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (v := _token_text(config.get(k))) is not None
        }
        eos_ids = _eos_ids(directory, tokenizer, specials)
        h = hashlib.sha256()
        for part in (
            tj.read_bytes(),
            template.encode(),
            json.dumps(specials, sort_keys=True).encode(),
        ):
            h.update(hashlib.sha256(part).digest())
        return cls(tokenizer, template, specials, eos_ids, "hf-sha256:" + h.hexdigest()[:32])

    # ---- text ----------------------------------------------------------------------------

    @functools.cached_property
    def special_texts(self) -> tuple[str, ...]:
        """The texts of the special tokens (``<|im_end|>``, ``<|eot_id|>`` ...): text that
        holds one is read as that token, the chat's structure, not as text."""
        added = self.tok.get_added_tokens_decoder().values()
        return tuple(sorted(t.content for t in added if t.special))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, specials: bool = False) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=not specials))

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> str:
        """The template's text of ``messages`` with ``tools`` (each ``{"name",
        "description", "parameters"}``) listed (rendered within the bounds of
        :mod:`pipeline.policy.template`; episodes never call this)."""
        return self.render_many([(messages, add_generation_prompt)], tools)[0]

    def render_many(
        self, conversations: Sequence[Conversation], tools: Sequence[Mapping[str, Any]] = ()
    ) -> list[str]:
        """:meth:`render` of several conversations with the same ``tools``, in one call of
        the bounded renderer (whose limits then hold for them together)."""
        listed = _functions(tools) or None
        return render_bounded(self.template_source, self.specials, conversations, listed)

    # ---- the pieces an episode appends ----------------------------------------------------

    def _probe(self) -> None:
        """Renders, once and within bounds, what the pieces are read from: the probe
        conversation, and each kind of message with a placeholder for its text."""
        user = [{"role": "user", "content": _PROBE_USER}]
        history = [*user, {"role": "assistant", "content": _PROBE_REPLY}]

        def slots(before: list[dict[str, Any]], role: str) -> list[Conversation]:
            return [
                ([*before, {"role": role, "content": text}], False) for text in (_SLOT, _PADDED)
            ]

        rendered = render_bounded(
            self.template_source,
            self.specials,
            [
                (user, False),
                (user, True),
                (history, False),
                *slots([], "user"),
                *slots(history, "tool"),
                *slots(history, "user"),
                *slots(user, "assistant"),
            ],
        )
        opened, prompted, whole = rendered[:3]
        if not prompted.startswith(opened):
            raise InvalidConfigError(
                "the chat template is not prefix-stable: its generation prompt rewrites the "
                "conversation before it"
            )
        self._header = prompted[len(opened) :]
        reply_at = whole.find(_PROBE_REPLY, len(opened))
        ends = [
            (at, t)
            for t in (self.decode([i], specials=True) for i in self.stop_tokens)
            if (at := whole.find(t, reply_at)) >= 0
        ]
        if not whole.startswith(prompted) or reply_at < 0 or not ends:
            raise InvalidConfigError(
                "the chat template is not prefix-stable: a reply does not follow the "
                "generation prompt and end with the end-of-turn token"
            )
        at, end = min(ends)
        # the probe conversation up to the end of the policy's turn, after its end token
        prefix = whole[: at + len(end)]
        self._opening = _Piece.read(rendered[3], rendered[4], "", "the user's first message")
        self._turns = {
            "tool": _Piece.read(rendered[5], rendered[6], prefix, "a tool's result"),
            "user": _Piece.read(rendered[7], rendered[8], prefix, "an observation"),
        }
        # a policy's turn as history: the header, its text as the template writes it
        # (trimmed or not), the end-of-turn token; a template that writes a reply in
        # another way is not refused for it (episodes never render a reply): its turns
        # are then taken as written, their text tokenized again
        try:
            reply = _Piece.read(rendered[9], rendered[10], opened, "the policy's reply")
        except InvalidConfigError:
            reply = _Piece(self._header, "", False)
        self._reply = reply._replace(after=end)

    @property
    def assistant_header(self) -> list[int]:
        """Tokens that open the policy's turn (the generation prompt)."""
        return self.encode(self._header)

    def opening(self, prompt: str, tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        """Tokens of the conversation up to the first policy turn: begin token, system
        prompt and the user's ``prompt``, as the template lays them out; with ``tools``
        (each ``{"name", "description", "parameters"}``) the template's own listing of
        them too, as transformers passes them (``tools=[{"type": "function", ...}]``).
        Each distinct list of tools is rendered once (within bounds) and kept."""
        if not tools:
            return self.encode(self._opening.text(prompt))
        listed = _functions(tools)
        key = json.dumps(listed, sort_keys=True, default=str)
        piece = self._openings.get(key)
        if piece is None:
            plain, padded = render_bounded(
                self.template_source,
                self.specials,
                [([{"role": "user", "content": text}], False) for text in (_SLOT, _PADDED)],
                tools=listed,
            )
            piece = _Piece.read(plain, padded, "", "the user's first message with tools")
            if len(self._openings) < 64:  # a process sees a few lists of tools, not more
                self._openings[key] = piece
        return self.encode(piece.text(prompt))

    def turn(self, role: str, text: str) -> list[int]:
        """Tokens of one more message (``tool`` for a tool's result, ``environment`` for
        an observation, given to the template as ``user``) after the policy's turn,
        including what the template writes between that turn's end token and it."""
        return self.encode(self._turns["tool" if role == "tool" else "user"].text(text))

    def as_history(self, sampled: Sequence[int]) -> list[int]:
        """The tokens the template writes for a policy turn whose sampled tokens are
        ``sampled`` when it renders the conversation at once: the generation prompt, the
        text (trimmed where the template trims), its own end-of-turn token. They differ
        from the header and ``sampled`` where the policy stopped with another stop token
        or not at all, wrote text the template trims, or sampled tokens that are not the
        tokenization of their own text."""
        body = list(sampled)
        if body and body[-1] in self.stop_tokens:
            body.pop()
        return self.encode(self._reply.text(self.decode(body, specials=True)))

    def retokenized(self, ids: Sequence[int]) -> list[int]:
        """``ids`` as the tokenization of their own text (special tokens' texts read as
        those tokens)."""
        return self.encode(self.decode(ids, specials=True))

    def parse_call(self, tokens: Sequence[int], stopped: int | None) -> tuple[str, str] | None:
        """``(tool name, arguments)`` when the policy's turn is a tool call in the
        template's format (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, or a
        bare JSON object with ``name`` and ``arguments`` or ``parameters``); arguments with
        a single value are passed as that value, others as JSON."""
        text = self.decode(tokens)
        start = text.find("<tool_call>")
        if start >= 0:
            end = text.find("</tool_call>", start)
            text = text[start + len("<tool_call>") : end if end >= 0 else None]
        text = text.strip()
        if not text.startswith("{"):
            return None
        try:
            call = json.loads(text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        return call["name"], argument_text(call.get("arguments", call.get("parameters", "")))


def argument_text(arguments: Any) -> str:
    """A tool call's arguments (a model's JSON object) as the text a tool is called with:
    the value itself when there is one, else the JSON."""
    if isinstance(arguments, dict) and len(arguments) == 1:
        arguments = next(iter(arguments.values()))
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _functions(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Tools (``{"name", "description", "parameters"}``) as transformers passes them to a
    chat template."""
    return [{"type": "function", "function": dict(t)} for t in tools]


class _Piece(NamedTuple):
    """What the template writes for one message: ``before``, the message's text (trimmed
    when the template trims it), ``after``."""

    before: str
    after: str
    trims: bool

    @classmethod
    def read(cls, plain: str, padded: str, prefix: str, what: str) -> _Piece:
        """The piece from renderings with the placeholder as the text, bare and padded
        with whitespace, after the conversation ``prefix``."""
        if not (plain.startswith(prefix) and padded.startswith(prefix)):
            raise InvalidConfigError(f"the chat template rewrites the history when {what} follows")
        plain, padded = plain[len(prefix) :], padded[len(prefix) :]
        if plain.count(_SLOT) != 1:
            raise InvalidConfigError(f"the chat template does not write {what} once, as given")
        before, after = plain.split(_SLOT)
        if padded == plain:
            return cls(before, after, True)
        if padded == before + _PADDED + after:
            return cls(before, after, False)
        raise InvalidConfigError(
            f"the chat template changes the text of {what} beyond trimming it: rlstream "
            "appends each message without rendering the conversation again"
        )

    def text(self, content: str) -> str:
        return self.before + (content.strip() if self.trims else content) + self.after


def _eos_ids(directory: Path, tokenizer: Tokenizer, specials: dict[str, str]) -> list[int]:
    """End-of-turn ids: ``generation_config.json``'s ``eos_token_id`` (one or a list), and
    the tokenizer configuration's ``eos_token``."""
    ids: list[int] = []
    gen = directory / "generation_config.json"
    if gen.is_file():
        value = load_json(gen, "generation configuration").get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31:
                ids.append(i)
    if "eos_token" in specials:
        eos = tokenizer.token_to_id(specials["eos_token"])
        if eos is not None:
            ids.append(eos)
    return sorted(set(ids))
