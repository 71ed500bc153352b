"""Which records of each partition are settled (trained or dropped), for exactly-once.

Records of one partition are read in order but settled out of order: members of a GRPO
group wait in a buffer until the group is complete, while later groups are trained. A
:class:`PositionTracker` keeps, per partition, the offsets read but not yet settled and
the settled ranges above the lowest unsettled offset. ``low(tp)`` is the position below
which everything is settled: what the trainer commits to Kafka and seeks to after a
restart; ``settled(tp, offset)`` tells a restarted trainer which records above it to skip.
"""

from __future__ import annotations

from typing import Any

TP = tuple[str, int]


class PositionTracker:
    def __init__(self) -> None:
        self._next: dict[TP, int] = {}
        self._pending: dict[TP, set[int]] = {}
        self._settled: dict[TP, list[list[int]]] = {}  # sorted, merged [start, end) ranges

    # ---- reading ---------------------------------------------------------------------

    def start(self, tp: TP, offset: int) -> None:
        """Reading of ``tp`` starts (again) at ``offset``; nothing is pending there."""
        self._next[tp] = offset
        self._pending[tp] = set()
        self._trim(tp)

    def read(self, tp: TP, offset: int) -> None:
        self._pending.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def let_go(self, tp: TP) -> None:
        """What was read of ``tp`` and not settled will be read again: reading restarts
        at ``low(tp)``, and the settled ranges above it stay known (so that they are
        skipped, not settled twice, when they are read again)."""
        self.start(tp, self.low(tp))

    # ---- settling --------------------------------------------------------------------

    def settle(self, tp: TP, offset: int) -> None:
        self.settle_range(tp, offset, offset + 1)

    def settle_range(self, tp: TP, start: int, end: int) -> None:
        """Offsets ``[start, end)`` are settled (trained, dropped, or skipped as stale)."""
        if end <= start:
            return
        pending = self._pending.get(tp, set())
        self._pending[tp] = {o for o in pending if not start <= o < end}
        self._next[tp] = max(self._next.get(tp, 0), end)
        ranges = self._settled.setdefault(tp, [])
        ranges.append([start, end])
        ranges.sort()
        merged: list[list[int]] = []
        for a, b in ranges:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self._settled[tp] = merged
        self._trim(tp)

    def skip(self, tp: TP, offset: int) -> None:
        """A record settled before a restart was read again: move past it."""
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)
        self._trim(tp)

    def unsettled(self, tp: TP, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` not settled yet (and not pending)."""
        out, cur = [], max(start, self.low(tp))
        for a, b in self._settled.get(tp, []):
            if b <= cur:
                continue
            if a >= end:
                break
            if a > cur:
                out.append((cur, min(a, end)))
            cur = max(cur, b)
        if cur < end:
            out.append((cur, end))
        pending = self._pending.get(tp, set())
        return [(a, b) for a, b in out if not any(a <= o < b for o in pending)]

    def is_settled(self, tp: TP, offset: int) -> bool:
        if offset < self.low(tp):
            return True
        return any(a <= offset < b for a, b in self._settled.get(tp, []))

    # ---- positions -------------------------------------------------------------------

    def low(self, tp: TP) -> int:
        """Everything below this offset is settled."""
        # every offset below ``next`` was read (pending or settled) or skipped (settled)
        pending = self._pending.get(tp)
        return min(pending) if pending else self._next.get(tp, 0)

    def next(self, tp: TP) -> int:
        return self._next.get(tp, 0)

    def pending_count(self, tp: TP | None = None) -> int:
        """Records read but not settled yet (waiting in groups or batches), of ``tp`` or
        of every partition."""
        if tp is not None:
            return len(self._pending.get(tp, ()))
        return sum(len(p) for p in self._pending.values())

    def _trim(self, tp: TP) -> None:
        low = self.low(tp)
        self._settled[tp] = [[max(a, low), b] for a, b in self._settled.get(tp, []) if b > low]

    # ---- persistence -----------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            f"{t}:{p}": {"low": self.low((t, p)), "settled": self._settled.get((t, p), [])}
            for (t, p) in sorted(set(self._next) | set(self._settled))
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PositionTracker:
        tracker = cls()
        for key, v in data.items():
            topic, _, part = key.rpartition(":")
            tp = (topic, int(part))
            tracker._next[tp] = int(v["low"])
            tracker._pending[tp] = set()
            tracker._settled[tp] = [[int(a), int(b)] for a, b in v["settled"]]
        return tracker

    def partitions(self) -> list[TP]:
        return sorted(self._next)
