"""The synchronous loop a user would write without rlstream: one process, no Kafka.

Each step generates a batch with the producers' decode engine (the same episodes, the same
slots, the same environment and latency), trains on it with the trainer's jitted step (the
same batch assembly, advantages and loss), and copies the new parameters into the engine
in memory; the trainer's state is checkpointed with orbax every ``checkpoint_every`` steps,
not at every step. Both parts come from a :class:`RunConfig`, so the run it is compared
with differs in the pipeline alone.

The times are split as the trainer's are: ``train_s`` (assembly and the step), and apart
from it ``generate_s`` (the trainer idle while episodes run), ``swap_s`` (copying the
parameters to the engine) and ``checkpoint_s``; the wall time runs from the end of the first
step to the end of the last, as ``bench async`` measures the pipeline.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from connectors.base import make
from pipeline.kafka.transport import Coordinates
from pipeline.launch.config import RunConfig
from pipeline.policy.hf_weights import initial_model
from pipeline.policy.sampler import DecodeEngine
from pipeline.policy.server import PolicyServer
from pipeline.policy.tokenizer import tokenizer_for
from pipeline.rollout.episode import GroupSlot, run_episode
from pipeline.train.batching import Group, Member, assemble
from pipeline.train.grpo import init_state, make_train_step


def run(cfg: RunConfig, run_dir: Path, checkpoint_every: int = 10) -> dict[str, Any]:
    """``cfg.steps`` steps of the loop; its times (see the module docstring)."""
    pc = cfg.producer(0, "in-process", run_dir)
    tc = cfg.trainer("in-process", run_dir)
    tokenizer = tokenizer_for(pc.model.path)
    engine = DecodeEngine(initial_model(pc.model, pc.model_seed), pc.concurrency, pc.sampling)
    server = PolicyServer(
        engine,
        tokenizer.stop_tokens,
        stop_sequences=tuple(tuple(tokenizer.encode(s)) for s in pc.stop_sequences),
    ).start()
    tx = tc.grpo.optimizer()
    graphdef, state = init_state(
        initial_model(tc.model, tc.seed, training=True), tx, reference=tc.grpo.kl_coef > 0
    )
    step_fn = make_train_step(graphdef, tc.grpo, tx, donate=True)
    for t in sorted(tc.buckets):  # compiled ahead, as the trainer's warm-up does
        empty = assemble([], tc.rows, tc.buckets, tc.grpo, length=t)[0]
        step_fn.lower(state, empty).compile()
    ckpt = ocp.CheckpointManager(
        (run_dir / "checkpoints").absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
    )
    tasks = make(pc.env, **pc.env_kwargs)
    rng = random.Random(pc.seed)
    timers = {"generate_s": 0.0, "train_s": 0.0, "swap_s": 0.0, "checkpoint_s": 0.0}
    ends: list[float] = []
    success: list[float] = []
    versions: list[int] = []  # the policy version each step's batch was sampled with
    try:
        for step in range(1, cfg.steps + 1):
            t0 = time.perf_counter()
            groups = asyncio.run(_generate(cfg, pc, tasks, rng, server, tokenizer))
            t1 = time.perf_counter()
            batch = assemble(groups, tc.rows, tc.buckets, tc.grpo)[0]
            state, metrics = step_fn(state, batch)
            jax.block_until_ready(metrics)
            t2 = time.perf_counter()
            # the engine keeps its own copy: the next step consumes (donates) this state
            server.swap(jax.tree.map(jnp.copy, state.params), step)
            t3 = time.perf_counter()
            if step % checkpoint_every == 0 or step == cfg.steps:
                ckpt.save(step, args=ocp.args.StandardSave(state))
                ckpt.wait_until_finished()
            t4 = time.perf_counter()
            if step > 1:  # the first step (compilation of the engine, warm caches) not timed
                for k, d in zip(timers, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    timers[k] += d
            ends.append(time.perf_counter())
            rewards = [m.trajectory.reward for g in groups for m in g.members.values()]
            success.append(sum(r > 0 for r in rewards) / max(1, len(rewards)))
            versions.append(
                max(m.trajectory.max_version for g in groups for m in g.members.values())
            )
    finally:
        server.stop()
        ckpt.close()
    wall = ends[-1] - ends[0]
    return {
        "wall_s": wall,
        "steps_measured": len(ends) - 1,
        **{k: round(v, 2) for k, v in timers.items()},
        "trainer_busy": timers["train_s"] / wall if wall > 0 else 0.0,
        "batch_success": success,
        "versions": versions,
    }


async def _generate(
    cfg: RunConfig, pc: Any, tasks: Any, rng: Any, server: PolicyServer, tokenizer: Any
) -> list[Group]:
    """One batch: ``groups_per_batch`` groups of ``group_size`` episodes, at most
    ``concurrency`` at once (one decode slot each), every one awaited."""
    free = list(range(pc.concurrency))
    ready = asyncio.Condition()
    groups: list[Group] = []

    async def one(g: Group, slot_of: GroupSlot) -> None:
        async with ready:
            await ready.wait_for(lambda: bool(free))
            slot = free.pop()
        try:
            env = make(pc.env, **pc.env_kwargs)
            t = await run_episode(env, slot_of, server, slot, tokenizer, pc.limits, pc.producer_id)
        finally:
            async with ready:
                free.append(slot)
                ready.notify()
        g.members[slot_of.group_index] = Member(t, Coordinates("in-process", 0, 0, 0))

    episodes = []
    for _ in range(cfg.groups_per_batch):
        task = tasks.sample_task(rng)
        gid = f"in-process-{uuid.uuid4().hex[:12]}"
        g = Group(gid, pc.env, cfg.group_size, time.monotonic())
        groups.append(g)
        episodes += [one(g, GroupSlot(gid, cfg.group_size, i, task)) for i in range(cfg.group_size)]
    await asyncio.gather(*episodes)
    return groups
