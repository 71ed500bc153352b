"""A byte-level tokenizer shipped with rlstream: no vocabulary file, no download.

Ids 0-255 are the bytes of UTF-8 text; the ids above are special tokens that mark turn
and tool boundaries. Every trajectory records :data:`TOKENIZER_ID`, and a trainer refuses
records written with another tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

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

    def turn(self, role: str, text: str) -> list[int]:
        """Tokens that open a turn of ``role`` and hold ``text`` (for non-policy turns;
        the policy's own turn is opened by :meth:`turn` with empty text and then sampled)."""
        return [self.special[f"<{role}>"], *self.encode(text)]
