"""From decoded trajectories to fixed-shape GRPO batches.

:class:`GroupBuffer` holds trajectories until their GRPO group is complete (an incomplete
group past its timeout is dropped; with a deadline, one that has enough members by then
is trained with them and its later members are refused as ``late``, or handed out one by
one to be trained with their group's earlier rewards as the baseline; the buffer is
bounded and drops its oldest groups when full). A member that repeats a group index or a
trajectory id already in its group, or arrives for a group completed recently, is refused
as ``duplicate``; one of another environment than its group as ``env_mismatch``: the
caller settles it with that reason.
:func:`assemble` turns complete groups into a :class:`~pipeline.train.grpo.Batch` of
one trajectory per row padded to a length bucket; :func:`pack` puts several trajectories
in each row (segments), in one of a handful of row counts. Either way the jitted step
sees a handful of shapes only.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pipeline.kafka.transport import Coordinates
from pipeline.records.trajectory import Trajectory
from pipeline.train.advantages import advantages, overlong_penalty
from pipeline.train.config import GRPOConfig
from pipeline.train.objective import Batch


@dataclass
class Member:
    trajectory: Trajectory
    where: Coordinates
    #: where a batch put it: its row and first column (set by :func:`assemble`/:func:`pack`)
    row: int = -1
    start: int = 0


@dataclass
class Group:
    group_id: str
    env: str
    size: int
    first_seen: float
    members: dict[int, Member] = field(default_factory=dict)
    ids: set[str] = field(default_factory=set)
    #: a late member's (one that came after its group was trained at its deadline, alone):
    #: the (shaped) rewards of the members its group was trained with; its advantage is
    #: computed over them and its own
    baseline: np.ndarray | None = None

    @property
    def late(self) -> bool:
        return self.baseline is not None

    @property
    def complete(self) -> bool:
        return len(self.members) == self.size

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among its members (-1: one has none)."""
        return min((m.trajectory.min_version for m in self.members.values()), default=-1)


class Refused(NamedTuple):
    """A member the buffer would not take: ``duplicate`` or ``env_mismatch`` (an invalid
    member, dead-lettered), ``group_refused`` (a valid member of a group that can no
    longer complete, dropped) or ``late`` (a valid member of a group trained without it
    at its deadline, dropped)."""

    reason: str
    detail: str

    @property
    def invalid(self) -> bool:
        """An invalid record (dead-lettered), not a valid member that is only dropped."""
        return self.reason not in ("group_refused", "late")


def _in_partitions(g: Group, tps: set[tuple[str, int]]) -> bool:
    return any((m.where.topic, m.where.partition) in tps for m in g.members.values())


class GroupBuffer:
    """Trajectories waiting for the rest of their group. ``add`` returns the group if it
    just became complete, a :class:`Refused` for a member that cannot join it, or None;
    ``expired``/``overflow`` return groups to drop, ``due`` incomplete groups to train as
    they are. The ids of the last ``remember`` completed groups are kept, so that a late
    repeat of a trained group is refused."""

    def __init__(
        self,
        max_records: int,
        timeout_s: float,
        remember: int = 65536,
        late_rewards: Callable[[Group], np.ndarray] | None = None,
    ) -> None:
        self.max_records = max_records
        self.timeout_s = timeout_s
        #: with it, a late member is handed out alone (a :class:`Group` with ``late``) with
        #: the rewards of its group's members trained before it, not refused
        self.late_rewards = late_rewards
        #: those rewards, per group that went partial
        self._baselines: dict[str, np.ndarray] = {}
        self._groups: OrderedDict[str, Group] = OrderedDict()
        #: groups handed out, each with its members' indices if it went partial
        self._done: OrderedDict[str, frozenset[int] | None] = OrderedDict()
        #: groups that lost a member to a refusal, and why: they can never complete
        self._refused: OrderedDict[str, str] = OrderedDict()
        self._remember = remember
        self.records = 0

    def add(self, t: Trajectory, where: Coordinates) -> Group | Refused | None:
        if t.group_id in self._done:
            trained = self._done[t.group_id]
            if trained is not None and t.group_index not in trained:
                if self.late_rewards is not None:
                    return self._late(t, where, trained)
                return Refused("late", f"group {t.group_id[:80]} went to training without it")
            return Refused("duplicate", f"group {t.group_id[:80]} is already complete")
        why = self._refused.get(t.group_id)
        if why is not None:
            return Refused("group_refused", f"another member of its group was refused ({why})")
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
            self._hand_out(g.group_id)
            return g
        return None

    def _late(self, t: Trajectory, where: Coordinates, trained: frozenset[int]) -> Group:
        """A late member, alone, with the rewards of the members its group was trained
        with at its deadline; a repeat of it is a duplicate from now on."""
        self._done[t.group_id] = trained | {t.group_index}
        g = Group(t.group_id, t.env, t.group_size, time.monotonic())
        g.members[t.group_index] = Member(t, where)
        g.ids.add(t.trajectory_id)
        g.baseline = self._baselines.get(t.group_id, np.zeros(0))
        return g

    def _hand_out(self, gid: str, partial: bool = False) -> Group:
        g = self._remove(gid)
        self._done[gid] = frozenset(g.members) if partial else None
        if partial and self.late_rewards is not None:
            self._baselines[gid] = self.late_rewards(g)
        if len(self._done) > self._remember:
            old, _ = self._done.popitem(last=False)
            self._baselines.pop(old, None)
        return g

    def due(self, deadline_s: float, min_members: int, now: float | None = None) -> list[Group]:
        """Groups still incomplete ``deadline_s`` after their first member arrived that
        hold at least ``min_members``: handed out to be trained as they are; a member of
        one that arrives later is refused as ``late``."""
        now = time.monotonic() if now is None else now
        due = [
            gid
            for gid, g in self._groups.items()
            if now - g.first_seen > deadline_s and len(g.members) >= min_members
        ]
        return [self._hand_out(gid, partial=True) for gid in due]

    def _remove(self, gid: str) -> Group:
        g = self._groups.pop(gid)
        self.records -= len(g.members)
        return g

    def refuse_group(self, gid: str, why: str) -> Group | None:
        """A member of group ``gid`` was refused, so the group can never complete: its
        waiting members are handed back at once (to be dropped, not left waiting for the
        timeout), and members that arrive later are refused as ``group_refused``. A
        group already complete is not affected (the refused record was a repeat)."""
        if gid in self._done:
            return None
        self._refused[gid] = why
        if len(self._refused) > self._remember:
            self._refused.popitem(last=False)
        return self._remove(gid) if gid in self._groups else None

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
        gone = [gid for gid, g in self._groups.items() if _in_partitions(g, tps)]
        return [self._remove(gid) for gid in gone]

    def __iter__(self) -> Iterator[Group]:
        return iter(list(self._groups.values()))

    def clear(self) -> list[Group]:
        """Let every waiting group go (its records will be read again)."""
        out = list(self._groups.values())
        self._groups.clear()
        self.records = 0
        return out

    def forget_done(self, groups: Iterable[Group]) -> None:
        """Groups completed but not trained, whose members will be read again (of a
        late member's, only it: its group's earlier members were trained)."""
        for g in groups:
            trained = self._done.get(g.group_id)
            if g.late and trained is not None:
                self._done[g.group_id] = trained - frozenset(g.members)
            else:
                self._done.pop(g.group_id, None)
                self._baselines.pop(g.group_id, None)


class GroupQueue:
    """Complete groups per environment, taken in proportion to ``weights``; within an
    environment the oldest policy version first (earliest deadline: a group goes stale
    ``max_staleness`` versions after its oldest member's), in arrival order among equals.
    Records reach the trainer from several partitions and producers in no global order,
    so arrival order alone can train a newer group while an older one, complete, waits
    a step longer and goes stale."""

    def __init__(self, weights: Mapping[str, float]) -> None:
        self.weights = dict(weights)
        self._queues: dict[str, deque[Group]] = {}
        self._taken: dict[str, int] = {}

    def put(self, g: Group) -> None:
        self._queues.setdefault(g.env, deque()).append(g)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def clear(self) -> list[Group]:
        """Let every queued group go (its records will be read again)."""
        out = [g for q in self._queues.values() for g in q]
        for q in self._queues.values():
            q.clear()
        return out

    def drop_partitions(self, tps: set[tuple[str, int]]) -> list[Group]:
        """Let the queued groups of partitions ``tps`` go (their records will be read
        again)."""
        out = []
        for q in self._queues.values():
            gone = [g for g in q if _in_partitions(g, tps)]
            for g in gone:
                q.remove(g)
            out += gone
        return out

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
            q = self._queues[env]
            first = min(range(len(q)), key=lambda i: q[i].oldest_version)  # (the first of equals)
            out.append(q[first])
            del q[first]
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


def all_rewards(g: Group, grpo: GRPOConfig) -> np.ndarray:
    """The rewards its advantages are computed over: a late member's group's earlier
    members' and its own; any other group's own (:func:`group_rewards`)."""
    own = group_rewards(g, grpo)
    return own if g.baseline is None else np.concatenate([g.baseline, own])


def _advantaged(groups: Sequence[Group], grpo: GRPOConfig) -> list[tuple[Member, float, float]]:
    """Each group's members in index order with their advantages
    (:mod:`pipeline.train.advantages`; 0 with a critic, which makes its own in the step)
    and their (shaped) rewards."""
    out = []
    for g in groups:
        pool = all_rewards(g, grpo)  # a late member's group's earlier rewards first
        rewards = pool[len(pool) - len(g.members) :]
        if grpo.advantage == "gae":
            adv = np.zeros_like(rewards)
        else:
            adv = advantages(pool, grpo.advantage, grpo.adv_eps)[len(pool) - len(rewards) :]
        out += [
            (g.members[i], float(adv[k]), float(rewards[k]))
            for k, i in enumerate(sorted(g.members))
        ]
    return out


def _mark_fresh(fresh: np.ndarray, r: int, at: int, t: Trajectory, version: int) -> None:
    """Mark the tokens of ``t`` (at row ``r``, column ``at``) that policy ``version``
    sampled: those whose sampler and trainer log-probabilities must agree."""
    for s in t.version_spans:
        if s.version == version:
            fresh[r, at + s.start : at + s.end] = 1.0


def _mask_stale(mask: np.ndarray, r: int, at: int, t: Trajectory, oldest: int) -> None:
    """No gradient through the tokens of ``t`` (at row ``r``, column ``at``) that a
    policy version older than ``oldest`` sampled."""
    for s in t.version_spans:
        if s.version < oldest:
            mask[r, at + s.start : at + s.end] = 0.0


def _last_policy_token(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask[1:]) + 1
    return int(hits[-1]) if len(hits) else None


def assemble(
    groups: Sequence[Group],
    rows: int,
    buckets: Sequence[int],
    grpo: GRPOConfig | None = None,
    length: int | None = None,
    version: int | None = None,
    oldest: int | None = None,
) -> tuple[Batch, list[Member]]:
    """A batch of exactly ``rows`` rows, one trajectory per row (padding rows have
    ``valid`` 0) and the members in row order, with each group's advantages; its length
    is the bucket of the longest member, or ``length`` (the group's agreed one). With
    ``version`` (the trainer's), ``fresh`` marks the tokens that version sampled; with
    ``oldest``, tokens of older versions get no gradient (``stale_tokens: mask``)."""
    grpo = grpo or GRPOConfig()
    rated = _advantaged(groups, grpo)
    longest = max((m.trajectory.num_tokens for m, _, _ in rated), default=0)
    t = bucket_for(longest, buckets) if length is None else length
    if t is None or longest > t:
        raise ValueError(f"trajectory of {longest} tokens exceeds the largest bucket")
    tokens = np.zeros((rows, t), np.int32)
    mask = np.zeros((rows, t), np.float32)
    behaviour = np.zeros((rows, t), np.float32)
    advantage = np.zeros(rows, np.float32)
    valid = np.zeros(rows, np.float32)
    reward = np.zeros((rows, t), np.float32)
    fresh = np.zeros((rows, t), np.float32)
    for r, (member, adv, rew) in enumerate(rated):
        tr = member.trajectory
        n = tr.num_tokens
        member.row, member.start = r, 0
        if version is not None:
            _mark_fresh(fresh, r, 0, tr, version)
        tokens[r, :n] = tr.tokens
        mask[r, 1:n] = tr.loss_mask[1:]  # the first token has no prediction to train
        if oldest is not None:
            _mask_stale(mask, r, 0, tr, oldest)
        behaviour[r, :n] = tr.logprobs
        advantage[r] = adv
        valid[r] = 1.0
        last = _last_policy_token(mask[r, :n])
        if last is not None:
            reward[r, last] = rew
    batch = Batch(tokens, mask, behaviour, advantage, valid)
    if grpo.advantage == "gae":
        batch = batch._replace(reward=reward)
    if version is not None:
        batch = batch._replace(fresh=fresh)
    return batch, [m for m, _, _ in rated]


def first_fit(lengths: Sequence[int], length: int) -> list[list[int]]:
    """Indices of ``lengths`` per row of ``length`` tokens: first fit, longest first."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if n > length:
            raise ValueError(f"trajectory of {n} tokens exceeds the packed length {length}")
        r = next((r for r, f in enumerate(free) if f >= n), None)
        if r is None:
            rows.append([])
            free.append(length)
            r = len(rows) - 1
        rows[r].append(i)
        free[r] -= n
    return rows


def rows_to_pack(groups: Sequence[Group], length: int) -> int:
    """How many rows of ``length`` tokens the groups' trajectories pack into."""
    lengths = [m.trajectory.num_tokens for g in groups for m in g.members.values()]
    return len(first_fit(lengths, length))


def row_choices(most: int, unit: int, shapes: int = 4) -> list[int]:
    """The row counts a packed batch is rounded up to: about ``shapes`` multiples of
    ``unit`` up to ``most``, so that the step is compiled for a handful of shapes."""
    step = max(unit, -(-most // shapes // unit) * unit)
    return sorted({*range(step, most, step), most})


def pack(
    groups: Sequence[Group],
    rows: int,
    length: int,
    grpo: GRPOConfig | None = None,
    first_row: int = 0,
    version: int | None = None,
    oldest: int | None = None,
) -> tuple[Batch, list[Member]]:
    """A packed batch of ``rows`` rows of ``length`` tokens: several trajectories per
    row, each its own segment (attention stays inside it, positions restart at 0) with
    its group's advantage on every token; the members in the order they were packed.
    Segment ids are the flat index of the segment's first token, counted from row
    ``first_row`` (this member's first row of a group's batch), so they are unique in
    the whole batch. ``version`` and ``oldest``: as for :func:`assemble`."""
    grpo = grpo or GRPOConfig()
    rated = _advantaged(groups, grpo)
    layout = first_fit([m.trajectory.num_tokens for m, _, _ in rated], length)
    if len(layout) > rows:
        raise ValueError(f"{len(rated)} trajectories need {len(layout)} rows, not {rows}")
    tokens = np.zeros((rows, length), np.int32)
    mask = np.zeros((rows, length), np.float32)
    behaviour = np.zeros((rows, length), np.float32)
    advantage = np.zeros((rows, length), np.float32)
    valid = np.zeros(rows, np.float32)
    base = (first_row + np.arange(rows, dtype=np.int64))[:, None] * length
    segment = np.broadcast_to(base, (rows, length)).copy()
    position = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy()
    reward = np.zeros((rows, length), np.float32)
    fresh = np.zeros((rows, length), np.float32)
    members = []
    for r, row in enumerate(layout):
        at = 0
        for i in row:
            member, adv, rew = rated[i]
            tr = member.trajectory
            n = tr.num_tokens
            member.row, member.start = r, at
            if version is not None:
                _mark_fresh(fresh, r, at, tr, version)
            tokens[r, at : at + n] = tr.tokens
            mask[r, at + 1 : at + n] = tr.loss_mask[1:]
            if oldest is not None:
                _mask_stale(mask, r, at, tr, oldest)
            behaviour[r, at : at + n] = tr.logprobs
            advantage[r, at : at + n] = adv
            segment[r, at : at + n] = base[r, 0] + at
            position[r, at : at + n] = np.arange(n)
            last = _last_policy_token(mask[r, at : at + n])
            if last is not None:
                reward[r, at + last] = rew
            members.append(member)
            at += n
        # the rest of the row is a segment of its own, positions from 0
        segment[r, at:] = base[r, 0] + at
        position[r, at:] = np.arange(length - at)
        valid[r] = 1.0
    if segment.max(initial=0) >= 2**31:
        raise ValueError("segment ids exceed int32")
    batch = Batch(
        tokens,
        mask,
        behaviour,
        advantage,
        valid,
        segment.astype(np.int32),
        position,
        reward if grpo.advantage == "gae" else None,
        fresh if version is not None else None,
    )
    return batch, members
