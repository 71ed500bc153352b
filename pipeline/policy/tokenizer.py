"""A byte-level tokenizer shipped with rlstream: no vocabulary file, no download.

Ids 0-255 are the bytes of UTF-8 text; the ids above are special tokens that mark turn
and tool boundaries. Every trajectory records :data:`TOKENIZER_ID`, and a trainer refuses
records written with another tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pipeline.policy.chat import ChatTokenizer

TOKENIZER_ID = "rlstream-bytes-v1"

SPECIALS = (
    "<pad>",
    "<bos>",
    "<eos>",
    "<system>",
    "<user>",
    "<assistant>",
    "<tool>",
    "<environment>",
    "<call>",
    "</call>",
)


class ChatFormat(Protocol):
    """What an episode needs of a tokenizer: the pieces of a conversation as tokens
    (implemented by :class:`ByteTokenizer` and :class:`pipeline.policy.chat.ChatTokenizer`)."""

    id: str
    vocab_size: int

    @property
    def stop_tokens(self) -> set[int]: ...

    @property
    def assistant_header(self) -> list[int]: ...

    def opening(self, prompt: str, tools: Sequence[Mapping[str, Any]] = ()) -> list[int]: ...

    def turn(self, role: str, text: str) -> list[int]: ...

    def parse_call(self, tokens: Sequence[int], stopped: int | None) -> tuple[str, str] | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, specials: bool = False) -> str: ...

    def as_history(self, sampled: Sequence[int]) -> list[int]: ...

    def retokenized(self, ids: Sequence[int]) -> list[int]: ...


def tokenizer_for(model_path: str) -> ChatFormat:
    """The tokenizer of a policy: its checkpoint directory's own, or the built-in bytes."""
    if not model_path:
        return ByteTokenizer()
    return ChatTokenizer.load(Path(model_path))


class ByteTokenizer:
    """UTF-8 bytes plus special tokens. ``vocab_size`` is rounded up to a multiple of 16."""

    id = TOKENIZER_ID

    def __init__(self) -> None:
        self.special = {name: 256 + i for i, name in enumerate(SPECIALS)}
        self._names = {v: k for k, v in self.special.items()}
        self.vocab_size = (256 + len(SPECIALS) + 15) // 16 * 16
        self.pad, self.bos, self.eos = (
            self.special["<pad>"],
            self.special["<bos>"],
            self.special["<eos>"],
        )
        self.call, self.end_call = self.special["<call>"], self.special["</call>"]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], *, specials: bool = False) -> str:
        """Text of ``ids``; special tokens dropped, or written by name if ``specials``."""
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
            if specials:
                out.append(self._names.get(i, f"<{i}>"))
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    @property
    def stop_tokens(self) -> set[int]:
        """Tokens that end the policy's turn."""
        return {self.eos, self.end_call}

    @property
    def assistant_header(self) -> list[int]:
        """Tokens that open the policy's turn."""
        return [self.special["<assistant>"]]

    def opening(self, prompt: str, tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        """Tokens of the conversation up to the first policy turn. The byte format has no
        template to list ``tools`` in: its environments' prompts describe their tools."""
        return [self.bos, *self.turn("user", prompt)]

    def parse_call(self, tokens: Sequence[int], stopped: int | None) -> tuple[str, str] | None:
        """``(tool name, arguments)`` of a turn that ended ``<call>name arguments</call>``."""
        if stopped != self.end_call:
            return None
        body = list(tokens[:-1])  # without the stop token
        idx = max((i for i, t in enumerate(body) if t == self.call), default=-1)
        name, _, args = self.decode(body[idx + 1 :]).partition(" ")
        return name, args

    def turn(self, role: str, text: str) -> list[int]:
        """Tokens that open a turn of ``role`` and hold ``text`` (for non-policy turns;
        the policy's own turn is opened by :meth:`turn` with empty text and then sampled)."""
        return [self.special[f"<{role}>"], *self.encode(text)]

    def as_history(self, sampled: Sequence[int]) -> list[int]:
        """The policy's turn (its header and ``sampled``) as the conversation's text
        encodes it: bytes that are not UTF-8 become U+FFFD; special tokens stay."""
        out = list(self.assistant_header)
        run: list[int] = []
        for i in [*sampled, -1]:
            if 0 <= i < 256:
                run.append(i)
                continue
            out += self.encode(bytes(run).decode("utf-8", errors="replace"))
            run = []
            if i >= 0:
                out.append(i)
        return out

    def retokenized(self, ids: Sequence[int]) -> list[int]:
        """``ids`` as their text encodes them: bytes never merge, so the same."""
        return list(ids)
