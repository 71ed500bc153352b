"""Held-out evaluation of a policy: success rate on episodes that no trainer ever saw.

Episodes run exactly as a producer runs them (the same policy server, episode loop and
sampling), but locally and without Kafka, on tasks drawn from a seed that producers do not
use, with no simulated latency. Success is as in the trainer's metrics.

The figure is reproducible: each episode's token draws come from the sampling seed, the
evaluation's seed and the episode's index (see ``DecodeEngine.reset``), not from the slot
or the order in which episodes were batched, so the same weights give the same figure at
any concurrency.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from connectors.base import close_shared, make
from pipeline.errors import RlstreamError
from pipeline.policy.config import ModelConfig, SamplingConfig
from pipeline.policy.hf_weights import initial_model
from pipeline.policy.sampler import DecodeEngine
from pipeline.policy.server import PolicyServer
from pipeline.policy.tokenizer import tokenizer_for
from pipeline.records.trajectory import success_by_tool_use, tool_call_rate, tool_error_rate
from pipeline.rollout.config import EpisodeLimits
from pipeline.rollout.episode import GroupSlot, run_episode

#: tasks of held-out episodes come from this seed (plus the evaluation's own seed)
HELD_OUT_SEED = 1_000_003


@dataclass(frozen=True)
class EvalResult:
    episodes: int
    success: float
    reward_mean: float
    statuses: Mapping[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    version: int = 0
    #: share of episodes that called a tool at least once
    tool_call_rate: float = 0.0
    #: share of tool calls that came back as errors
    tool_error_rate: float = 0.0
    #: success of the episodes that called a tool, and of those that answered without
    #: one (None: no such episode)
    success_with_tool: float | None = None
    success_without_tool: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "episodes": self.episodes,
            "success": self.success,
            "reward_mean": self.reward_mean,
            "statuses": dict(self.statuses),
            "seconds": self.seconds,
            "version": self.version,
            "tool_call_rate": self.tool_call_rate,
            "tool_error_rate": self.tool_error_rate,
            "success_with_tool": self.success_with_tool,
            "success_without_tool": self.success_without_tool,
        }


def evaluate(
    env: str,
    *,
    model: ModelConfig,
    params: Any = None,
    version: int = 0,
    model_seed: int = 0,
    episodes: int = 200,
    seed: int = 0,
    concurrency: int = 64,
    env_options: Mapping[str, Any] | None = None,
    limits: EpisodeLimits | None = None,
    sampling: SamplingConfig | None = None,
    stop_sequences: tuple[str, ...] = (),
    tools: Sequence[str] = (),
) -> EvalResult:
    """Play ``episodes`` held-out episodes with ``params`` (an ``nnx.State`` of parameters,
    e.g. from :func:`pipeline.policy.checkpoint.restore_params`), or with the initial parameters
    of ``model_seed`` when ``params`` is None."""
    tokenizer = tokenizer_for(model.path)
    engine = DecodeEngine(initial_model(model, model_seed), min(concurrency, episodes), sampling)
    if params is not None:
        engine.swap(params, version)
    server = PolicyServer(
        engine,
        tokenizer.stop_tokens,
        stop_sequences=tuple(tuple(tokenizer.encode(s)) for s in stop_sequences),
    )
    limits = limits or EpisodeLimits()
    options = {**(env_options or {}), **({"tools": tuple(tools)} if tools else {})}
    rng = random.Random(HELD_OUT_SEED + seed)
    tasks = [make(env, **options).held_out_task(rng) for _ in range(episodes)]

    async def play() -> list[Any]:
        free = asyncio.Queue[int]()
        for s in range(engine.slots):
            free.put_nowait(s)

        async def one(i: int) -> Any:
            slot = await free.get()
            try:
                # the episode's draws follow from the seed and its index, not its slot
                member = GroupSlot(f"eval-{seed}-{i}", 1, 0, tasks[i])
                return await run_episode(
                    make(env, **options), member, server, slot, tokenizer, limits, "eval"
                )
            finally:
                free.put_nowait(slot)

        try:
            return await asyncio.gather(*(one(i) for i in range(episodes)))
        finally:
            await close_shared()

    start = time.perf_counter()
    server.start()
    try:
        trajectories = asyncio.run(play())
    finally:
        server.stop()
    if server.error is not None:  # its episodes ended as failures: no result to report
        raise RlstreamError(
            f"the evaluation's policy failed: {type(server.error).__name__}: "
            f"{str(server.error)[:300]}"
        )
    rewards = [t.reward for t in trajectories]
    with_tool, without_tool = success_by_tool_use(trajectories)
    return EvalResult(
        episodes=len(rewards),
        success=sum(t.succeeded for t in trajectories) / max(1, len(rewards)),
        reward_mean=sum(rewards) / max(1, len(rewards)),
        statuses=dict(Counter(t.status for t in trajectories)),
        seconds=time.perf_counter() - start,
        version=engine.version,
        tool_call_rate=tool_call_rate(trajectories),
        tool_error_rate=tool_error_rate(trajectories),
        success_with_tool=with_tool,
        success_without_tool=without_tool,
    )


def evaluate_weights(
    env: str,
    *,
    model: ModelConfig,
    weights: Path | None,
    version: int = 0,
    model_seed: int = 0,
    episodes: int = 200,
    seed: int = 0,
    max_new_tokens: int = EpisodeLimits.max_new_tokens,
    temperature: float = 1.0,
    env_options: Mapping[str, Any] | None = None,
    tools: Sequence[str] = (),
) -> EvalResult:
    """:func:`evaluate` of the parameters a trainer saved at ``weights`` (a
    ``weights/v<N>`` folder: full parameters, or LoRA adapters on their base), or of the
    initial parameters of ``model_seed`` when None, sampled as producers sample them."""
    from pipeline.policy.checkpoint import find_weights, saved_model_config
    from pipeline.policy.lora import restore_weights

    if weights is not None:
        # the weights decide the model they are evaluated in
        weights = find_weights(weights)
        saved = saved_model_config(weights)
        if not saved.same_architecture(model):
            model = saved

    return evaluate(
        env,
        env_options=env_options,
        model=model,
        params=restore_weights(weights, model) if weights is not None else None,
        version=version,
        model_seed=model_seed,
        episodes=episodes,
        seed=seed,
        limits=EpisodeLimits(max_new_tokens=max_new_tokens),
        sampling=SamplingConfig(temperature, 1.0, seed),
        tools=tools,
    )


def latest_weights(run_dir: Path) -> tuple[int, Path] | None:
    """The newest ``weights/v<N>`` a trainer saved under ``run_dir``."""
    found = []
    for p in (run_dir / "weights").glob("v*"):
        if p.name[1:].isdigit() and p.is_dir():
            found.append((int(p.name[1:]), p))
    return max(found) if found else None
