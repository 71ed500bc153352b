"""The per-step ledger: which records each step trained and which it dropped, and why.

One JSON line per training step in ``<run>/ledger.jsonl`` (and one for drops settled
while no step ran, at a checkpoint without training). Each record is named by its
trajectory id (None when it was dropped before decoding) and its Kafka coordinates. Lines
carry a sequence number ``seq``; a checkpoint records the ``seq`` of the last line it
covers, lines are durable before their checkpoint is written, and after a restart the
lines above the restored checkpoint's ``seq`` are removed (that work is done again). So
the ledger always describes exactly what the durable state contains.

A trainer group of several processes keeps one ledger per member: member 0's in the run
directory, member ``i``'s in ``members/<i>/`` under it (:func:`member_dir`);
:func:`run_ledger` reads them all as one.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any


class Ledger:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.trained: list[list[Any]] = []
        self.dropped: list[list[Any]] = []
        self.seq = 0
        if path.exists():
            lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
            self.seq = json.loads(lines[-1])["seq"] if lines else 0

    def train(self, trajectory_id: str, topic: str, partition: int, offset: int) -> None:
        self.trained.append([trajectory_id, topic, partition, offset])

    def drop(
        self, trajectory_id: str | None, topic: str, partition: int, offset: int, reason: str
    ) -> None:
        self.dropped.append([trajectory_id, topic, partition, offset, reason])

    def drop_range(self, topic: str, partition: int, start: int, end: int, reason: str) -> None:
        """Records ``[start, end)`` skipped without reading them."""
        self.dropped.append([None, topic, partition, [start, end], reason])

    @property
    def dirty(self) -> bool:
        return bool(self.trained or self.dropped)

    def close_step(self, step: int, version: int, extra: dict[str, Any] | None = None) -> int:
        """Write the line of ``step`` and make it durable; returns its ``seq``."""
        self.seq += 1
        line = {
            "seq": self.seq,
            "step": step,
            "version": version,
            "trained": self.trained,
            "dropped": self.dropped,
            **(extra or {}),
        }
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.trained, self.dropped = [], []
        return self.seq

    def truncate_after(self, seq: int) -> int:
        """Remove lines after ``seq`` (work a restart redoes); returns how many."""
        self.trained, self.dropped = [], []
        self.seq = seq
        if not self.path.exists():
            return 0
        lines = self.path.read_text().splitlines()
        keep = [ln for ln in lines if ln.strip() and json.loads(ln)["seq"] <= seq]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        os.replace(tmp, self.path)
        return len(lines) - len(keep)


def read_ledger(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def member_dir(run_dir: Path, index: int) -> Path:
    """Where trainer member ``index`` keeps its own files (ledger, metrics): the run
    directory for member 0 (and a trainer alone), ``members/<i>`` under it for others."""
    return run_dir if index == 0 else run_dir / "members" / str(index)


def run_ledger(run_dir: Path) -> list[dict[str, Any]]:
    """Every member's ledger lines of the run in ``run_dir`` (none if it has none)."""
    paths = [run_dir / "ledger.jsonl", *sorted((run_dir / "members").glob("*/ledger.jsonl"))]
    return [e for p in paths if p.exists() for e in read_ledger(p)]


def durable_ledger(run_dir: Path) -> list[dict[str, Any]]:
    """The ledger lines of every member that the run's newest checkpoint covers: what a
    restart keeps. A line above it may still be removed by the next start (its work is
    then done again), so a count of what is settled reads these."""
    root = run_dir / "checkpoints"
    done = [int(p.name) for p in root.iterdir() if p.name.isdigit()] if root.is_dir() else []
    if not done:
        return []
    meta = json.loads((root / str(max(done)) / "meta" / "metadata").read_text())
    out = []
    for i, member in enumerate(meta.get("members", [meta])):  # older: one trainer's seq
        path = member_dir(run_dir, i) / "ledger.jsonl"
        if path.exists():
            out += [e for e in read_ledger(path) if e["seq"] <= member["seq"]]
    return out


def outcomes(entries: list[dict[str, Any]]) -> dict[tuple[str, int, int], list[str]]:
    """What happened to each record the ledger settled, by (topic, partition, offset):
    ``"trained"`` or the drop reason, once per time it was settled (so a list longer than
    one means a record was trained or dropped twice)."""
    seen: dict[tuple[str, int, int], list[str]] = {}
    for e in entries:
        for _tid, topic, part, off in e["trained"]:
            seen.setdefault((topic, part, off), []).append("trained")
        for _tid, topic, part, off, reason in e["dropped"]:
            for o in range(*off) if isinstance(off, list) else (off,):
                seen.setdefault((topic, part, o), []).append(reason)
    return seen


def drop_counts(entries: list[dict[str, Any]]) -> Counter[str]:
    return Counter(d[4] for e in entries for d in e["dropped"])
