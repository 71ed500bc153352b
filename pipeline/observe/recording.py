"""Recorded trajectories shown to a person (``rlstream replay``): one record as text
(turns, rewards, versions, Kafka coordinates) or as a JSON summary, what the run's ledger
says of it, and the filters that choose which records to show."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import RlstreamError
from pipeline.kafka.replay import Recorded
from pipeline.records.trajectory import Trajectory


@dataclass(frozen=True)
class LedgerIndex:
    """What a run's ledger says of each record: trained at which step (and the trainer's
    version then), or dropped at which step and why."""

    trained: dict[str, tuple[int, int]]
    dropped_at: dict[tuple[str, int, int], tuple[int, str]]
    ranges: list[tuple[str, int, int, int, int, str]]
    entries: list[dict[str, Any]]

    @classmethod
    def load(cls, run_dir: Path) -> LedgerIndex:
        from pipeline.records.ledger import read_ledger, run_ledger

        path = run_dir / "ledger.jsonl" if run_dir.is_dir() else run_dir
        if not path.exists():
            raise RlstreamError(f"no ledger at {path}")
        # a run directory: every trainer member's ledger
        entries = run_ledger(run_dir) if run_dir.is_dir() else read_ledger(path)
        trained, dropped, ranges = {}, {}, []
        for e in entries:
            for tid, *_ in e["trained"]:
                trained[tid] = (e["step"], e["version"] - 1)  # the version it trained
            for _tid, topic, part, where, reason in e["dropped"]:
                if isinstance(where, list):
                    ranges.append((topic, part, where[0], where[1], e["step"], reason))
                else:
                    dropped[(topic, part, where)] = (e["step"], reason)
        return cls(trained, dropped, ranges, entries)

    def fate(self, r: Recorded) -> str:
        t = r.trajectory
        if t is not None and t.trajectory_id in self.trained:
            step, version = self.trained[t.trajectory_id]
            stale = f", staleness {version - t.min_version}" if t.min_version >= 0 else ""
            return f"trained at step {step} (trainer version {version}{stale})"
        hit = self.dropped_at.get((r.topic, r.partition, r.offset))
        if hit is None:
            for topic, part, a, b, step, reason in self.ranges:
                if topic == r.topic and part == r.partition and a <= r.offset < b:
                    hit = (step, reason)
                    break
        if hit is not None:
            return f"dropped at step {hit[0]}: {hit[1]}"
        return "not in the ledger (not reached by this run)"

    def step(self, n: int) -> dict[str, Any]:
        lines = [e for e in self.entries if e["step"] == n]
        if not lines:
            raise RlstreamError(f"the ledger has no step {n}")
        return {
            "step": n,
            "version": max(e["version"] for e in lines),
            "trained": [x for e in lines for x in e["trained"]],
            "dropped": [x for e in lines for x in e["dropped"]],
        }


def parse_filter(text: str | None) -> Callable[[Recorded], bool]:
    """``env=guess,status=ok,min_reward=0.5`` (also ``max_reward``, ``producer``,
    ``group``, ``decodable=false``)."""
    wanted: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise RlstreamError(f"filter {item!r} is not KEY=VALUE")
        if key not in _FILTERS:
            raise RlstreamError(f"unknown filter {key!r}: {', '.join(_FILTERS)}")
        if key in ("min_reward", "max_reward"):
            try:
                float(value)
            except ValueError:
                raise RlstreamError(f"filter {key} needs a number, not {value!r}") from None
        wanted[key] = value

    def keep(r: Recorded) -> bool:
        return all(_FILTERS[k](r, v) for k, v in wanted.items())

    return keep


def _traj_is(r: Recorded, attr: str, value: str) -> bool:
    return r.trajectory is not None and str(getattr(r.trajectory, attr)) == value


_FILTERS: dict[str, Callable[[Recorded, str], bool]] = {
    "env": lambda r, v: r.env == v,
    "status": lambda r, v: _traj_is(r, "status", v),
    "producer": lambda r, v: _traj_is(r, "producer_id", v),
    "group": lambda r, v: _traj_is(r, "group_id", v),
    "min_reward": lambda r, v: r.trajectory is not None and r.trajectory.reward >= float(v),
    "max_reward": lambda r, v: r.trajectory is not None and r.trajectory.reward <= float(v),
    "decodable": lambda r, v: (r.trajectory is not None) == (v.lower() in ("1", "true", "yes")),
}


def _text(t: Trajectory, start: int, end: int) -> str:
    """Tokens ``[start, end)`` of ``t`` as text: the built-in byte tokenizer's are read;
    a checkpoint's own tokenizer is not at hand here, so those are shown as ids."""
    from pipeline.policy.tokenizer import ByteTokenizer

    ids = t.tokens[start:end].tolist()
    if t.tokenizer_id.startswith("hf-"):
        shown = " ".join(map(str, ids[:64]))
        return f"[{len(ids)} token ids: {shown}{' ...' if len(ids) > 64 else ''}]"
    return ByteTokenizer().decode(ids)


def render(r: Recorded, ledger: LedgerIndex | None = None) -> str:
    """A recorded trajectory for a person to read."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.timestamp_ms / 1000))
    head = f"== {r.topic}[{r.partition}]@{r.offset}  {when} UTC"
    t = r.trajectory
    if t is None:
        lines = [head, f"   undecodable ({len(r.raw or b'')} bytes): {r.error}"]
        if ledger:
            lines.append(f"   {ledger.fate(r)}")
        return "\n".join(lines)
    spans = ", ".join(f"v{s.version}:{s.start}-{s.end}" for s in t.version_spans) or "none"
    lines = [
        f"{head}  env={t.env}  status={t.status}  reward={t.reward:g}",
        f"   trajectory {t.trajectory_id}  group {t.group_id} ({t.group_index + 1}/"
        f"{t.group_size})  task {t.task_id}  producer {t.producer_id}",
        f"   tokens {t.num_tokens} (policy {int(t.loss_mask.sum())})  version spans {spans}",
    ]
    if ledger:
        lines.append(f"   {ledger.fate(r)}")
    versions = {(s.start, s.end): s.version for s in t.version_spans}
    for turn in t.turns:
        text = _text(t, turn.start, turn.end)
        label = turn.role
        if turn.role == "assistant":
            vs = sorted({v for (a, b), v in versions.items() if a < turn.end and b > turn.start})
            label += f" [v{','.join(map(str, vs))}]" if vs else ""
        if turn.tool_name:
            label += f" ({'calls' if turn.role == 'assistant' else 'result of'} {turn.tool_name})"
        lines.append(f"   {label}: {text!r}")
    rewards = " ".join(f"{k}={v:g}" for k, v in sorted(t.rewards.items()))
    lines.append(f"   rewards: {rewards or 'none'}")
    return "\n".join(lines)


def summary_json(r: Recorded, ledger: LedgerIndex | None = None) -> dict[str, Any]:
    """A recorded record for other tools: coordinates, the trajectory's scalars, the
    conversation as text, and its fate in the ledger."""

    out: dict[str, Any] = {
        "topic": r.topic,
        "partition": r.partition,
        "offset": r.offset,
        "timestamp_ms": r.timestamp_ms,
        "error": r.error,
    }
    t = r.trajectory
    if t is not None:
        out |= {
            "trajectory_id": t.trajectory_id,
            "group_id": t.group_id,
            "env": t.env,
            "status": t.status,
            "reward": t.reward,
            "rewards": dict(t.rewards),
            "producer_id": t.producer_id,
            "version_spans": [s._asdict() for s in t.version_spans],
            "turns": [
                {
                    "role": turn.role,
                    "tool": turn.tool_name,
                    "text": _text(t, turn.start, turn.end),
                }
                for turn in t.turns
            ],
        }
    if ledger:
        out["ledger"] = ledger.fate(r)
    return out
