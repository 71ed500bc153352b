"""Whether a record's tokens are those of its conversation rendered at once.

An episode appends each piece of its conversation as tokens and never re-tokenizes
(:mod:`pipeline.policy.chat`): the trainer scores exactly the tokens the sampler drew.
A pipeline that renders the conversation's text at once by the chat template and
tokenizes it (as ``apply_chat_template`` does) would score other tokens where

- the template rewrites a policy turn: the policy stopped with a stop token other than
  the template's end-of-turn token, or not at all, or wrote text the template trims, or
  sampled tokens that are not the tokenization of their own text (``rewritten_turns``);
- the pieces, put together, tokenize otherwise than the whole text at once: a piece
  whose tokens would merge across its edge (``divergent_context``: none is expected; the
  tests render 10,000 fuzzed conversations of the shipped templates at once to show it).

The producer checks every record it writes and counts both in its status. What a
template does to a reply beyond trimming it (a template may rewrite history in any way)
the check cannot see: such a template's turns are checked for their tokenization alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.policy.tokenizer import ChatFormat
from pipeline.records.trajectory import Turn


@dataclass
class Exactness:
    """Counts over the records a producer wrote."""

    #: records checked
    checked: int = 0
    #: policy turns the template would write otherwise (see the module)
    rewritten_turns: int = 0
    #: records whose context pieces tokenize otherwise than their text at once
    divergent_context: int = 0

    def add(
        self, fmt: ChatFormat, tokens: np.ndarray, mask: np.ndarray, turns: Sequence[Turn]
    ) -> bool:
        """Check one record; True when its context diverges."""
        rewritten, diverges = check(fmt, tokens, mask, turns)
        self.checked += 1
        self.rewritten_turns += rewritten
        self.divergent_context += diverges
        return diverges


def check(
    fmt: ChatFormat, tokens: np.ndarray, mask: np.ndarray, turns: Sequence[Turn]
) -> tuple[int, bool]:
    """``(policy turns the template would write otherwise, whether the context pieces
    tokenize otherwise than their text at once)`` for one record. Each policy turn is
    replaced by the template's writing of it before the context is checked, so that the
    one count does not spill into the other."""
    ids = np.asarray(tokens).tolist()
    rewritten = 0
    at_once: list[int] = []
    for turn in turns:
        seg = ids[turn.start : turn.end]
        if turn.role != "assistant":
            at_once += seg
            continue
        sampled = np.flatnonzero(mask[turn.start : turn.end])
        first = int(sampled[0]) if len(sampled) else len(seg)
        written = fmt.as_history(seg[first:])
        rewritten += written != seg
        at_once += written
    return rewritten, fmt.retokenized(at_once) != at_once
