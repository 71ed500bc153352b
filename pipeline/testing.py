"""Helpers shipped for tests, benchmarks and smoke runs: synthetic trajectories.

A synthetic trajectory follows the record contract exactly (alternating user and
assistant turns, policy tokens masked and versioned), so it exercises the same code
paths as a real rollout without a policy or an environment.
"""

from __future__ import annotations

import time
import uuid

import numpy as np

from pipeline.trajectory import (
    LOGPROB_DTYPE,
    MASK_DTYPE,
    TOKEN_DTYPE,
    Timings,
    Trajectory,
    Turn,
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
        turns=tuple(turn_list),
        reward=float(rng.random()) if reward is None else reward,
        rewards={"correct": 1.0},
        status="ok",
        timings=Timings(now - 1000, now, 0.5, 0.5),
        metadata={"source": "synthetic"},
    )


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
