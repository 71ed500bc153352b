"""Episodes a run trained on, read back from its rollout topic and shown as conversations.

The ledger names every trajectory each step trained (topic, partition, offset); the
report shows the best and the worst of the first step and of the last, as a person reads
them: the prompt, each policy turn and each answer of the environment, in order.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from pipeline.errors import RecordDecodeError
from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.transport import read_ranges
from pipeline.policy.tokenizer import ChatFormat
from pipeline.records.codec import TrajectoryCodec
from pipeline.records.trajectory import Trajectory

log = logging.getLogger(__name__)

FENCE = "`" * 3  # a text block's fence, never inside one

ROLES = {"user": "environment", "tool": "tool", "assistant": "policy", "system": "system"}


@dataclasses.dataclass(frozen=True)
class Sample:
    """One shown episode: which step trained it, and why it was chosen."""

    title: str
    step: int
    trajectory: Trajectory


def trained_at(entries: Sequence[dict[str, Any]], step: int) -> list[tuple[str, int, int]]:
    """Coordinates of the trajectories the ledger says step ``step`` trained."""
    return [(t, p, o) for e in entries if e["step"] == step for _tid, t, p, o in e["trained"]]


def fetch(
    kafka: KafkaConfig, where: Sequence[tuple[str, int, int]], idle_timeout_s: float = 10.0
) -> list[Trajectory]:
    """The trajectories at ``where`` that the topic still holds and that decode."""
    wanted = set(where)
    ranges: dict[tuple[str, int], tuple[int, int]] = {}
    for t, p, o in wanted:
        a, b = ranges.get((t, p), (o, o + 1))
        ranges[(t, p)] = (min(a, o), max(b, o + 1))
    codec = TrajectoryCodec()
    consumer = kafka.consumer(None)
    out = []
    try:
        for m in read_ranges(consumer, ranges, idle_timeout_s=idle_timeout_s):
            if (m.topic, m.partition, m.offset) in wanted:
                try:
                    out.append(codec.decode(m.value or b""))
                except RecordDecodeError:
                    continue
    except TimeoutError as e:  # records gone by retention: show what was found
        log.info("episodes: %s", e)
    finally:
        consumer.close()
    return out


def samples(
    kafka: KafkaConfig, entries: Sequence[dict[str, Any]], first: int, last: int
) -> list[Sample]:
    """The best and the worst trajectory (by reward) of steps ``first`` and ``last``."""
    out = []
    for step, when in ((first, "first"), (last, "last")):
        found = sorted(fetch(kafka, trained_at(entries, step)), key=lambda t: t.reward)
        if found:
            out.append(Sample(f"best of the {when} step", step, found[-1]))
            out.append(Sample(f"worst of the {when} step", step, found[0]))
        if first == last:
            break
    return out


def conversation(t: Trajectory, tokenizer: ChatFormat, max_chars: int = 400) -> list[str]:
    """The episode as ``role: text`` lines (control characters shown escaped, each turn
    cut at ``max_chars``)."""
    lines = []
    for turn in t.turns:
        text = _printable(tokenizer.decode(t.tokens[turn.start : turn.end].tolist()).strip())
        if len(text) > max_chars:
            text = text[:max_chars] + f" ... ({len(text) - max_chars} more characters)"
        role = ROLES.get(turn.role, turn.role)
        tool = f" (calls {_printable(turn.tool_name)})" if turn.tool_name else ""
        lines.append(f"{role}{tool}: {text}".replace(FENCE, "'''"))
    lines.append(f"(episode over: {t.status}, reward {t.reward:g})")
    return lines


def _printable(text: str) -> str:
    """Control characters as escapes, so that a line stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def render(shown: Sequence[Sample], tokenizer: ChatFormat) -> list[str]:
    """Markdown: each sample's heading line and its conversation in a text block."""
    out = []
    for s in shown:
        t = s.trajectory
        lo, hi = t.min_version, t.max_version
        version = "none" if lo < 0 else str(lo) if lo == hi else f"{lo} to {hi}"
        out += [
            f"**{s.title}** (step {s.step}): reward {t.reward:.2f}, {t.status}, task "
            f"`{t.task_id}`, policy version {version}, {t.num_tokens} tokens",
            "",
            "```text",
            *conversation(t, tokenizer),
            "```",
            "",
        ]
    return out
