"""Helpers shipped for tests, benchmarks and smoke runs: synthetic trajectories and a
scripted policy.

A synthetic trajectory follows the record contract exactly (alternating user and
assistant turns, policy tokens masked and versioned), so it exercises the same code
paths as a real rollout without a policy or an environment.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from pipeline.policy.config import SamplingConfig
from pipeline.policy.tokenizer import ByteTokenizer, ChatFormat
from pipeline.policy.turn import TurnResult
from pipeline.records.trajectory import (
    LOGPROB_DTYPE,
    MASK_DTYPE,
    TOKEN_DTYPE,
    Timings,
    Trajectory,
    Turn,
    Turns,
    VersionSpan,
)


def make_trajectory(
    num_tokens: int = 4096,
    *,
    rng: np.random.Generator | None = None,
    env: str = "synthetic",
    group_id: str | None = None,
    group_size: int = 1,
    group_index: int = 0,
    versions: tuple[int, ...] = (0,),
    turns: int = 8,
    reward: float | None = None,
    producer_id: str = "synthetic-0",
    tokenizer_id: str = "bytes-v1",
) -> Trajectory:
    """A valid trajectory of ``num_tokens`` tokens in ``turns`` turns (user/assistant
    alternating, the assistant's tokens being policy tokens), its policy tokens split
    evenly across ``versions``."""
    rng = rng or np.random.default_rng()
    tokens = rng.integers(0, 260, size=num_tokens, dtype=np.int32).astype(TOKEN_DTYPE)
    mask = np.zeros(num_tokens, dtype=MASK_DTYPE)
    bounds = np.linspace(0, num_tokens, max(turns, 1) + 1).astype(int)
    turn_list = []
    for i in range(len(bounds) - 1):
        start, end = int(bounds[i]), int(bounds[i + 1])
        role = "assistant" if i % 2 else "user"
        if role == "assistant":
            mask[start:end] = 1
        turn_list.append(Turn(role, start, end))
    logprobs = np.where(mask == 1, -rng.random(num_tokens, dtype=np.float32), 0).astype(
        LOGPROB_DTYPE
    )
    spans = _spans(mask, versions)
    now = int(time.time() * 1000)
    return Trajectory(
        trajectory_id=str(uuid.uuid4()),
        group_id=group_id or str(uuid.uuid4()),
        group_size=group_size,
        group_index=group_index,
        task_id="task-0",
        producer_id=producer_id,
        env=env,
        tokenizer_id=tokenizer_id,
        tokens=tokens,
        loss_mask=mask,
        logprobs=logprobs,
        version_spans=spans,
        turns=Turns.of(turn_list),
        reward=float(rng.random()) if reward is None else reward,
        rewards={"correct": 1.0},
        status="ok",
        timings=Timings(now - 1000, now, 0.5, 0.5),
        metadata={"source": "synthetic"},
    )


def group_member(group_id: str, index: int, rng: np.random.Generator, **kw: Any) -> Trajectory:
    """Member ``index`` of a GRPO group of four ``math`` trajectories of 40 tokens in two
    turns, written with the built-in byte tokenizer (``kw`` overrides any of it)."""
    fields: dict[str, Any] = dict(
        rng=rng,
        env="math",
        group_id=group_id,
        group_size=4,
        group_index=index,
        turns=2,
        tokenizer_id=ByteTokenizer.id,
    )
    fields.update(kw)
    return make_trajectory(fields.pop("num_tokens", 40), **fields)


def _spans(mask: np.ndarray, versions: tuple[int, ...]) -> tuple[VersionSpan, ...]:
    positions = np.flatnonzero(mask)
    if not len(positions) or not versions:
        return ()
    chunks = np.array_split(positions, len(versions))
    spans = []
    for chunk, version in zip(chunks, versions, strict=True):
        if len(chunk):
            spans.append(VersionSpan(int(chunk[0]), int(chunk[-1]) + 1, version))
    return tuple(spans)


class ScriptedPolicy:
    """Stands in for a :class:`~pipeline.policy.server.PolicyServer`: each turn says the
    next of ``turns`` (token lists), so that tests drive episodes deterministically (tool
    calls, exact answers) without a model. ``fed`` records what each turn was given."""

    def __init__(self, turns: list[list[int]], tokenizer: ChatFormat | None = None) -> None:
        self.turns = list(turns)
        self.fed: list[list[int]] = []
        self.engine = self
        self.sampling = SamplingConfig()
        self.logprob_temperature = self.sampling.logprob_temperature
        self.shared_prompt_tokens = 0
        self.version = 0
        self.max_len = 1000
        tok = tokenizer or ByteTokenizer()
        self._stops = tok.stop_tokens

    @classmethod
    def says(cls, *texts: str) -> ScriptedPolicy:
        """A byte-tokenizer policy answering each turn with the next text; a text that
        starts with ``<call>`` is a tool call (``<call>NAME ARGUMENTS``)."""
        tok = ByteTokenizer()
        turns = []
        for t in texts:
            if t.startswith("<call>"):
                turns.append([tok.call, *tok.encode(t[len("<call>") :]), tok.end_call])
            else:
                turns.append([*tok.encode(t), tok.eos])
        return cls(turns, tok)

    def room(self, slot: int) -> int:
        return 1000

    async def generate(
        self,
        slot: int,
        tokens: list[int],
        max_new: int,
        *,
        reset: bool = False,
        stream: int | None = None,
    ) -> TurnResult:
        self.fed.append(list(tokens))
        out = self.turns.pop(0)
        stop = out[-1] if out[-1] in self._stops else None
        return TurnResult(out, [-0.5] * len(out), [0] * len(out), stop)

    def release(self, slot: int) -> None:
        pass


def weights_chunks(
    files: Mapping[str, bytes], transfer_id: str, version: int, piece: int
) -> list[dict[str, Any]]:
    """The ``WeightsChunk`` records of a sending of ``files`` (relative name -> bytes, in
    the digest's order), ``piece`` bytes each, each with its own SHA-256."""
    out: list[dict[str, Any]] = []
    for rel, data in files.items():
        for offset in range(0, len(data), piece):
            chunk = data[offset : offset + piece]
            out.append(
                {
                    "transfer_id": transfer_id,
                    "policy_version": version,
                    "index": len(out),
                    "file": rel,
                    "offset": offset,
                    "file_size": len(data),
                    "data": chunk,
                    "sha256": hashlib.sha256(chunk).hexdigest(),
                }
            )
    return out
