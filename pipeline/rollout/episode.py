"""One multi-turn episode, recorded token in, token out.

The conversation is kept as exactly the token sequence the sampler consumed and produced,
laid out by the tokenizer's chat format (:class:`pipeline.policy.tokenizer.ChatFormat`);
with the built-in byte tokenizer:

    <bos> <user> prompt <assistant> policy tokens... (<eos> | </call>)
          <tool> result <assistant> policy tokens... <eos>
          <environment> observation <assistant> ...

and with a checkpoint's own tokenizer, the pieces its chat template writes for the same
messages (:mod:`pipeline.policy.chat`). Nothing is ever re-tokenized.

Policy tokens carry mask 1, their behaviour log-probability and the policy version that
sampled them; everything else has mask 0. An exception in the environment (or a reward
that is not finite or past its bound) ends the episode with ``env_error``, a step past its
timeout with ``timeout``, a context that cannot hold the next turn with ``truncated``;
each still becomes a record. Observations are cut to ``max_observation_tokens``, and
nothing is handed to the policy that does not fit in its context.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from connectors.base import Environment, Task
from pipeline.errors import RlstreamError
from pipeline.observe.telemetry import no_span, span, tracer
from pipeline.policy.server import Policy, TurnResult
from pipeline.policy.tokenizer import ChatFormat
from pipeline.records.trajectory import (
    LOGPROB_DTYPE,
    MASK_DTYPE,
    META_TEMPERATURE,
    META_TOOL_ERRORS,
    TOKEN_DTYPE,
    Timings,
    Trajectory,
    Turn,
    Turns,
    VersionSpan,
)
from pipeline.rollout.config import EpisodeLimits

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class GroupSlot:
    """Which group member an episode is."""

    group_id: str
    group_size: int
    group_index: int
    task: Task

    @property
    def stream(self) -> int:
        """The random stream of the episode's token draws (see ``DecodeEngine.reset``):
        from the group and member, so that a replayed episode draws the same tokens."""
        return zlib.crc32(f"{self.group_id}\0{self.group_index}".encode())


class _Recorder:
    """Accumulates tokens, mask, log-probabilities, versions and turns."""

    def __init__(self, max_observation_tokens: int) -> None:
        self.tokens: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.turns: list[Turn] = []
        self.max_observation_tokens = max_observation_tokens

    def context(self, role: str, tokens: list[int], latency_s: float = 0.0, tool: str = "") -> None:
        tokens = tokens[: self.max_observation_tokens]
        start = len(self.tokens)
        self.tokens += tokens
        self.mask += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.versions += [-1] * len(tokens)
        self.turns.append(Turn(role, start, len(self.tokens), tool, latency_s))

    def forget_after(self, n: int) -> None:
        """Drop the tokens from ``n`` on (whole context turns never handed to the policy)."""
        for seq in (self.tokens, self.mask, self.logprobs, self.versions):
            del seq[n:]
        self.turns = [t for t in self.turns if t.start < n]

    def policy(self, header: list[int], r: TurnResult, latency_s: float, tool: str = "") -> None:
        start = len(self.tokens)
        self.tokens += header
        self.mask += [0] * len(header)
        self.logprobs += [0.0] * len(header)
        self.versions += [-1] * len(header)
        self.tokens += r.tokens
        self.mask += [1] * len(r.tokens)
        self.logprobs += r.logprobs
        self.versions += r.versions
        self.turns.append(Turn("assistant", start, len(self.tokens), tool, latency_s))

    def spans(self) -> list[VersionSpan]:
        out: list[VersionSpan] = []
        for pos, (m, v) in enumerate(zip(self.mask, self.versions, strict=True)):
            if not m:
                continue
            if out and out[-1].version == v:
                out[-1] = VersionSpan(out[-1].start, pos + 1, v)
            else:
                out.append(VersionSpan(pos, pos + 1, v))
        return out


async def run_episode(
    env: Environment,
    member: GroupSlot,
    server: Policy,
    slot: int,
    tokenizer: ChatFormat,
    limits: EpisodeLimits,
    producer_id: str,
    on_turn: Callable[[TurnResult], None] | None = None,
) -> Trajectory:
    """Play one episode in decode slot ``slot`` and return its trajectory; ``on_turn`` is
    told of each policy turn as it is sampled."""
    rec = _Recorder(limits.max_observation_tokens)
    started = time.time()
    gen_s = env_s = 0.0
    reward, status = 0.0, "ok"
    rewards: dict[str, float] = {}
    calls = tool_errors = 0
    header = tokenizer.assistant_header

    deadline = time.monotonic() + limits.episode_timeout_s

    track = f"slot-{slot}"
    # the spans inside an episode, for the slots the tracer details (the episode's own span
    # carries the environment and policy seconds of every episode)
    inner = span if tracer().detailed(slot) else no_span

    async def timed(aw: Awaitable[T], what: str = "env_step", **attrs: str) -> T:
        """An environment call bounded by the step timeout and the episode's deadline."""
        nonlocal env_s
        t0 = time.perf_counter()
        left = min(limits.step_timeout_s, deadline - time.monotonic())
        try:
            # the episode's span on the same track carries env and group: spans inside it
            # stay small, as they are the most frequent of all
            with inner(what, track, **attrs):
                return await asyncio.wait_for(aw, max(0.0, left))
        finally:
            env_s += time.perf_counter() - t0

    try:
        t0 = time.perf_counter()
        prompt = await timed(env.reset(member.task), "env_reset")
        # the environment's tools (its own and its MCP servers'), as the template lists them
        listed = env.tools.describe() if env.tools is not None else ()
        rec.context("user", tokenizer.opening(prompt, listed), time.perf_counter() - t0)
        fed = 0  # tokens of rec already handed to the policy
        for turn_index in range(limits.max_policy_turns):
            t0 = time.perf_counter()
            feed = [*rec.tokens[fed:], *header]
            room = server.max_len if turn_index == 0 else server.room(slot)
            if len(feed) >= room:  # not even one token could be sampled after it
                rec.forget_after(fed)  # the record holds only what the policy saw
                status = "truncated"
                break
            with inner("policy_turn", track):
                turn = await server.generate(
                    slot,
                    feed,
                    limits.max_new_tokens,
                    reset=turn_index == 0,
                    stream=member.stream,
                )
            latency = time.perf_counter() - t0
            gen_s += latency
            if on_turn is not None:
                on_turn(turn)
            call = tokenizer.parse_call(turn.tokens, turn.stopped)
            if call is not None:
                name, args = call
                rec.policy(header, turn, latency, name)
                fed = len(rec.tokens)
                t0 = time.perf_counter()
                try:
                    result = await timed(env.call_tool(name, args), "tool_call", tool=name)
                except KeyError:
                    result = f"error: no tool named {name!r}"
                calls += 1
                tool_errors += result.startswith("error:")
                rec.context("tool", tokenizer.turn("tool", result), time.perf_counter() - t0, name)
                continue
            rec.policy(header, turn, latency)
            fed = len(rec.tokens)
            if turn.stopped is None and server.room(slot) < 1:
                status = "truncated"
                break
            t0 = time.perf_counter()
            step = await timed(env.step(tokenizer.decode(turn.tokens)))
            reward += float(step.reward)
            if not abs(reward) <= limits.max_abs_reward:  # also NaN and infinity
                raise RewardOutOfBoundsError(
                    f"reward {step.reward!r} brings the episode's to {reward!r}, past "
                    f"{limits.max_abs_reward:g}"
                )
            rewards.update(_components(step.info))
            if step.done:
                break
            rec.context(
                "environment",
                tokenizer.turn("environment", step.observation),
                time.perf_counter() - t0,
            )
        else:
            status = "truncated"
    except TimeoutError:
        status = "timeout"
    except asyncio.CancelledError:
        server.release(slot)
        raise
    except Exception as e:  # any environment failure ends this episode only
        log.warning("episode env_error env=%s group=%s error=%r", env.name, member.group_id, e)
        status = "env_error"
    finally:
        try:
            await asyncio.wait_for(env.close(), limits.step_timeout_s)
        except Exception:  # closing is best effort
            pass
    if status != "ok":  # an episode that did not end well has no components to report
        rewards.clear()
    rewards["env"] = reward
    tracer().record(
        "episode",
        int(started * 1e9),
        time.time_ns(),
        track,
        {
            "env": env.name,
            "group": member.group_id,
            "status": status,
            "env_s": round(env_s, 6),
            "policy_s": round(gen_s, 6),
        },
    )
    return _trajectory(
        member,
        env.name,
        tokenizer.id,
        producer_id,
        rec,
        reward=reward if status == "ok" else 0.0,
        rewards=rewards,
        status=status,
        timings=Timings(int(started * 1000), int(time.time() * 1000), gen_s, env_s),
        metadata={
            "task": member.task.task_id,
            META_TEMPERATURE: repr(server.logprob_temperature),
            **({META_TOOL_ERRORS: str(tool_errors)} if calls else {}),
        },
    )


#: the most reward components an environment's step may report, and their names' length
MAX_COMPONENTS, MAX_COMPONENT_NAME = 32, 64


def _components(info: Mapping[str, Any]) -> dict[str, float]:
    """The reward's components an environment reported (``info["rewards"]``): names to
    finite numbers, bounded; anything else in it is left out (``env`` is the reward's)."""
    given = info.get("rewards") if isinstance(info, Mapping) else None
    if not isinstance(given, Mapping):
        return {}
    out: dict[str, float] = {}
    for name, value in list(given.items())[:MAX_COMPONENTS]:
        if (
            isinstance(name, str)
            and name
            and name != "env"
            and len(name) <= MAX_COMPONENT_NAME
            and isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
        ):
            out[name] = float(value)
    return out


def _trajectory(
    member: GroupSlot,
    env: str,
    tokenizer_id: str,
    producer_id: str,
    rec: _Recorder,
    **fields: Any,
) -> Trajectory:
    return Trajectory(
        trajectory_id=str(uuid.uuid4()),
        group_id=member.group_id,
        group_size=member.group_size,
        group_index=member.group_index,
        task_id=member.task.task_id,
        producer_id=producer_id,
        env=env,
        tokenizer_id=tokenizer_id,
        tokens=np.asarray(rec.tokens, TOKEN_DTYPE),
        loss_mask=np.asarray(rec.mask, MASK_DTYPE),
        logprobs=np.asarray(rec.logprobs, LOGPROB_DTYPE),
        version_spans=rec.spans(),
        turns=Turns.of(rec.turns),
        **fields,
    )


class RewardOutOfBoundsError(RlstreamError):
    """An environment's reward is not finite or past the episode's bound."""


def failed_trajectory(
    member: GroupSlot, env: str, tokenizer_id: str, producer_id: str, error: str
) -> Trajectory:
    """The record of an episode that could not be recorded as played (e.g. its record
    broke the contract): no tokens, reward 0, status ``env_error``, the error in its
    metadata. Its group stays complete, and the failure is counted where it is trained."""
    now = int(time.time() * 1000)
    return _trajectory(
        member,
        env,
        tokenizer_id,
        producer_id,
        _Recorder(0),
        reward=0.0,
        rewards={},
        status="env_error",
        timings=Timings(now, now),
        metadata={"task": member.task.task_id[:200], "error": error[:500]},
    )
