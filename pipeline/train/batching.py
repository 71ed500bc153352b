"""From decoded trajectories to fixed-shape GRPO batches.

:class:`GroupBuffer` holds trajectories until their GRPO group is complete (an incomplete
group past its timeout is dropped; the buffer is bounded and drops its oldest groups when
full). A member that repeats a group index or a trajectory id already in its group, or
arrives for a group completed recently, is refused as ``duplicate``; one of another
environment than its group as ``env_mismatch``: the caller settles it with that reason.
:func:`assemble` turns complete groups into a :class:`~pipeline.train.grpo.Batch`
padded to a length bucket, so that the jitted step sees a handful of shapes only.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pipeline.kafka.transport import Coordinates
from pipeline.records.trajectory import Trajectory
from pipeline.train.advantages import advantages, overlong_penalty
from pipeline.train.config import GRPOConfig
from pipeline.train.grpo import Batch


@dataclass
class Member:
    trajectory: Trajectory
    where: Coordinates


@dataclass
class Group:
    group_id: str
    env: str
    size: int
    first_seen: float
    members: dict[int, Member] = field(default_factory=dict)
    ids: set[str] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return len(self.members) == self.size


class Refused(NamedTuple):
    """A member the buffer would not take: ``duplicate`` or ``env_mismatch``."""

    reason: str
    detail: str


class GroupBuffer:
    """Trajectories waiting for the rest of their group. ``add`` returns the group if it
    just became complete, a :class:`Refused` for a member that cannot join it, or None;
    ``expired``/``overflow`` return groups to drop. The ids of the last ``remember``
    completed groups are kept, so that a late repeat of a trained group is refused."""

    def __init__(self, max_records: int, timeout_s: float, remember: int = 65536) -> None:
        self.max_records = max_records
        self.timeout_s = timeout_s
        self._groups: OrderedDict[str, Group] = OrderedDict()
        self._done: OrderedDict[str, None] = OrderedDict()
        self._remember = remember
        self.records = 0

    def add(self, t: Trajectory, where: Coordinates) -> Group | Refused | None:
        if t.group_id in self._done:
            return Refused("duplicate", f"group {t.group_id[:80]} is already complete")
        g = self._groups.get(t.group_id)
        if g is None:
            g = self._groups[t.group_id] = Group(t.group_id, t.env, t.group_size, time.monotonic())
        if t.group_index in g.members or t.trajectory_id in g.ids:  # the first one stays
            return Refused(
                "duplicate",
                f"group {t.group_id[:80]} already holds index {t.group_index} or trajectory "
                f"{t.trajectory_id[:80]}",
            )
        if t.env != g.env:
            return Refused("env_mismatch", f"env {t.env[:80]!r} in a group of {g.env[:80]!r}")
        g.members[t.group_index] = Member(t, where)
        g.ids.add(t.trajectory_id)
        self.records += 1
        if g.complete:
            self._remove(g.group_id)
            self._done[g.group_id] = None
            if len(self._done) > self._remember:
                self._done.popitem(last=False)
            return g
        return None

    def _remove(self, gid: str) -> Group:
        g = self._groups.pop(gid)
        self.records -= len(g.members)
        return g

    def expired(self, now: float | None = None) -> list[Group]:
        now = time.monotonic() if now is None else now
        old = [gid for gid, g in self._groups.items() if now - g.first_seen > self.timeout_s]
        return [self._remove(gid) for gid in old]

    def overflow(self) -> list[Group]:
        out = []
        while self.records > self.max_records and self._groups:
            out.append(self._remove(next(iter(self._groups))))
        return out

    def drop_partitions(self, tps: set[tuple[str, int]]) -> list[Group]:
        gone = [
            gid
            for gid, g in self._groups.items()
            if any((m.where.topic, m.where.partition) in tps for m in g.members.values())
        ]
        return [self._remove(gid) for gid in gone]

    def __iter__(self) -> Iterator[Group]:
        return iter(list(self._groups.values()))


class GroupQueue:
    """Complete groups per environment, taken in proportion to ``weights``."""

    def __init__(self, weights: Mapping[str, float]) -> None:
        self.weights = dict(weights)
        self._queues: dict[str, deque[Group]] = {}
        self._taken: dict[str, int] = {}

    def put(self, g: Group) -> None:
        self._queues.setdefault(g.env, deque()).append(g)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def take(self, n: int) -> list[Group]:
        """``n`` groups: each time from the environment furthest below its share."""
        out: list[Group] = []
        while len(out) < n:
            ready = [e for e, q in self._queues.items() if q]
            if not ready:
                break

            def deficit(env: str) -> float:
                w = self.weights.get(env, 1.0)
                return self._taken.get(env, 0) / max(w, 1e-9)

            env = min(ready, key=deficit)
            out.append(self._queues[env].popleft())
            self._taken[env] = self._taken.get(env, 0) + 1
        return out


def bucket_for(length: int, buckets: Sequence[int]) -> int | None:
    return next((b for b in sorted(buckets) if length <= b), None)


def group_rewards(g: Group, grpo: GRPOConfig) -> np.ndarray:
    """The rewards of a group's members in index order, with DAPO's overlong shaping
    when configured."""
    out = []
    for i in sorted(g.members):
        t = g.members[i].trajectory
        shaping = overlong_penalty(
            int(t.loss_mask.sum()),
            grpo.overlong_max_tokens,
            grpo.overlong_buffer,
            grpo.overlong_penalty,
        )
        out.append(float(t.reward) + shaping)
    return np.asarray(out, np.float64)


def assemble(
    groups: Sequence[Group],
    rows: int,
    buckets: Sequence[int],
    grpo: GRPOConfig | None = None,
    length: int | None = None,
) -> tuple[Batch, list[Member]]:
    """A batch of exactly ``rows`` rows (padding rows have ``valid`` 0) and the members in
    row order, with each group's advantages (:mod:`pipeline.train.advantages`); its length
    is the bucket of the longest member, or ``length`` (the group's agreed one)."""
    grpo = grpo or GRPOConfig()
    members = [m for g in groups for m in (g.members[i] for i in sorted(g.members))]
    longest = max((m.trajectory.num_tokens for m in members), default=0)
    t = bucket_for(longest, buckets) if length is None else length
    if t is None or longest > t:
        raise ValueError(f"trajectory of {longest} tokens exceeds the largest bucket")
    tokens = np.zeros((rows, t), np.int32)
    mask = np.zeros((rows, t), np.float32)
    behaviour = np.zeros((rows, t), np.float32)
    advantage = np.zeros(rows, np.float32)
    valid = np.zeros(rows, np.float32)
    r = 0
    for g in groups:
        adv = advantages(group_rewards(g, grpo), grpo.advantage, grpo.adv_eps)
        for k, i in enumerate(sorted(g.members)):
            tr = g.members[i].trajectory
            n = tr.num_tokens
            tokens[r, :n] = tr.tokens
            mask[r, :n] = tr.loss_mask
            behaviour[r, :n] = tr.logprobs
            advantage[r] = adv[k]
            valid[r] = 1.0
            r += 1
    return Batch(tokens, mask, behaviour, advantage, valid), members
