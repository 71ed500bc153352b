"""The trajectory record in Python: numpy arrays, named tuples and one validation.

A :class:`Trajectory` is what a rollout producer builds and a trainer reads. Its arrays
are exactly the tokens the sampler saw and produced (token in, token out); the record
contract (lengths, spans, finite rewards) is checked by :func:`find_violation`, which
both the encoder (refusing to write) and the decoder (refusing to read) use.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from pipeline.records.avro_program import native_enabled

ROLES = ("system", "user", "assistant", "tool", "environment")
STATUSES = ("ok", "truncated", "env_error", "timeout")

TOKEN_DTYPE = np.dtype("<i4")
MASK_DTYPE = np.dtype("u1")
LOGPROB_DTYPE = np.dtype("<f4")


#: the default bound of any reward's magnitude, for producers and trainer alike
MAX_ABS_REWARD = 1e6

#: metadata key of the softmax temperature a record's log-probabilities were taken at (a
#: float's repr); a trainer refuses a record whose temperature is not its own, since its
#: importance ratios would compare two different distributions. A record without it is
#: taken to be at the trainer's temperature.
META_TEMPERATURE = "rlstream.logprob_temperature"
#: metadata key: how many of the episode's tool calls came back as errors (the result
#: text starts with ``error:``: an unknown tool, arguments its schema refuses, a timeout,
#: the tool's own failure); absent where the episode made no tool call
META_TOOL_ERRORS = "rlstream.tool_errors"


class VersionSpan(NamedTuple):
    """Tokens ``[start, end)`` were sampled by policy version ``version``."""

    start: int
    end: int
    version: int


class Turn(NamedTuple):
    """One turn of the conversation: tokens ``[start, end)`` written by ``role``."""

    role: str
    start: int
    end: int
    tool_name: str = ""
    latency_s: float = 0.0


ROLE_INDEX = {role: i for i, role in enumerate(ROLES)}
TURN_ROLE_DTYPE = np.dtype("u1")
TURN_POS_DTYPE = np.dtype("<i4")
TURN_LATENCY_DTYPE = np.dtype("<f8")


class Turns(Sequence[Turn]):
    """The turns of a conversation as columns (what a version-2 record carries): reading
    and checking them costs the same few array operations whatever their number.

    ``roles`` uint8 (index into :data:`ROLES`), ``starts`` and ``ends`` int32,
    ``latency_s`` float64, all of one length N; ``tool_names`` N strings, or none at all
    when no turn names a tool. Indexing gives :class:`Turn` tuples.
    """

    __slots__ = ("ends", "latency_s", "roles", "starts", "tool_names")

    def __init__(
        self,
        roles: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        latency_s: np.ndarray,
        tool_names: Sequence[str] = (),
    ) -> None:
        self.roles = roles
        self.starts = starts
        self.ends = ends
        self.latency_s = latency_s
        self.tool_names = tool_names

    @classmethod
    def of(cls, turns: Sequence[Turn]) -> Turns:
        """Columns of ``turns`` (a :class:`Turns` is returned as it is). Raises
        ValueError for a role that is not one of :data:`ROLES`."""
        if isinstance(turns, Turns):
            return turns
        try:
            roles = [ROLE_INDEX[t.role] for t in turns]
        except KeyError as e:
            raise ValueError(f"unknown role {e.args[0]!r}") from None
        names = [t.tool_name for t in turns]
        return cls(
            np.array(roles, TURN_ROLE_DTYPE),
            np.array([t.start for t in turns], TURN_POS_DTYPE),
            np.array([t.end for t in turns], TURN_POS_DTYPE),
            np.array([t.latency_s for t in turns], TURN_LATENCY_DTYPE),
            names if any(names) else (),
        )

    def __len__(self) -> int:
        return int(self.roles.shape[0])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return Turn(
            ROLES[self.roles[i]],
            int(self.starts[i]),
            int(self.ends[i]),
            self.tool_names[i] if self.tool_names else "",
            float(self.latency_s[i]),
        )

    def __iter__(self) -> Iterator[Turn]:
        names = self.tool_names or ("",) * len(self)
        for role, start, end, name, latency in zip(
            self.roles.tolist(),
            self.starts.tolist(),
            self.ends.tolist(),
            names,
            self.latency_s.tolist(),
            strict=True,
        ):
            yield Turn(ROLES[role], start, end, name, latency)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Turns({list(self)!r})"

    def __reduce__(self) -> Any:
        return Turns, (self.roles, self.starts, self.ends, self.latency_s, self.tool_names)


class Timings(NamedTuple):
    """Wall-clock timings of an episode (epoch milliseconds and seconds spent)."""

    started_at_ms: int
    finished_at_ms: int
    generation_s: float = 0.0
    env_s: float = 0.0


#: the reward component by which an environment says an episode solved its task
SOLVED = "solved"


def succeeded(reward: float, rewards: Mapping[str, float]) -> bool:
    """An episode's success: ``rewards["solved"] > 0`` where the environment reports it,
    else ``reward > 0``."""
    solved = rewards.get(SOLVED)
    return bool(solved > 0) if solved is not None else reward > 0


def tool_error_rate(trajectories: Iterable[Trajectory]) -> float:
    """The share of the trajectories' tool calls that came back as errors (0 without
    calls)."""
    calls = errors = 0
    for t in trajectories:
        calls += t.tool_calls
        errors += t.tool_errors
    return errors / calls if calls else 0.0


def tool_call_rate(trajectories: Sequence[Trajectory]) -> float:
    """The share of the trajectories that called a tool at least once (0 without any)."""
    return sum(t.tool_calls > 0 for t in trajectories) / len(trajectories) if trajectories else 0.0


def success_by_tool_use(trajectories: Sequence[Trajectory]) -> tuple[float | None, float | None]:
    """Success of the trajectories that called a tool, and of those that answered without
    one (None where there are none): what the tool is worth to the policy, and its no-tool
    answers as a baseline."""
    called = [t.succeeded for t in trajectories if t.tool_calls > 0]
    alone = [t.succeeded for t in trajectories if t.tool_calls == 0]
    return (
        sum(called) / len(called) if called else None,
        sum(alone) / len(alone) if alone else None,
    )


@dataclass(slots=True, eq=False)
class Trajectory:
    """One finished episode. Arrays are 1-D and of equal length ``T``:

    - ``tokens`` int32: prompt, policy tokens and observations, in order;
    - ``loss_mask`` uint8: 1 where the policy generated the token;
    - ``logprobs`` float32: behaviour log-probability of each policy token, 0 elsewhere.

    Fields are in the order of ``Trajectory.avsc`` (the decoder relies on it). Decoded
    trajectories hold read-only arrays.
    """

    trajectory_id: str
    group_id: str
    group_size: int
    group_index: int
    task_id: str
    producer_id: str
    env: str
    tokenizer_id: str
    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    version_spans: Sequence[VersionSpan]
    turns: Sequence[Turn]
    reward: float
    rewards: Mapping[str, float]
    status: str
    timings: Timings
    metadata: Mapping[str, str]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def succeeded(self) -> bool:
        """Whether the episode counts as a success: its environment's ``solved``
        component where it reports one (environments that give partial credit, which a
        positive reward would count), else a positive reward."""
        return succeeded(self.reward, self.rewards)

    @property
    def tool_calls(self) -> int:
        """How many tool results the episode holds: the tool calls the policy made."""
        turns = self.turns
        if isinstance(turns, Turns):
            return int(np.count_nonzero(turns.roles == ROLE_INDEX["tool"]))
        return sum(t.role == "tool" for t in turns)

    @property
    def tool_errors(self) -> int:
        """How many of its tool calls came back as errors (:data:`META_TOOL_ERRORS`);
        a value that is not a count in ``[0, tool_calls]`` reads as 0."""
        text = self.metadata.get(META_TOOL_ERRORS, "")
        n = int(text) if text.isascii() and text.isdigit() and len(text) < 10 else 0
        return n if n <= self.tool_calls else 0

    @property
    def min_version(self) -> int:
        """Oldest policy version among the policy tokens (-1 when there are none)."""
        return min((s.version for s in self.version_spans), default=-1)

    @property
    def max_version(self) -> int:
        """Newest policy version among the policy tokens (-1 when there are none)."""
        return max((s.version for s in self.version_spans), default=-1)


def find_violation(t: Trajectory, *, native: bool = True) -> tuple[str, str] | None:
    """The first way ``t`` breaks the record contract, as ``(reason, message)``, or None.

    Reasons are those of :class:`pipeline.errors.RecordDecodeError`. Cost is a few
    vectorised passes over the arrays, no per-token Python work; where the C extension
    ``_contract_native`` is built (and ``native``), one call makes every array pass.
    """
    if t.group_size < 1 or not 0 <= t.group_index < t.group_size:
        return "invalid", f"group_index {t.group_index} outside group_size {t.group_size}"
    tokens, mask, logprobs = t.tokens, t.loss_mask, t.logprobs
    if tokens.ndim != 1 or mask.ndim != 1 or logprobs.ndim != 1:
        return "length_mismatch", "tokens, loss_mask and logprobs must be 1-D"
    n = tokens.shape[0]
    if mask.shape[0] != n or logprobs.shape[0] != n:
        return (
            "length_mismatch",
            f"tokens has {n} entries, loss_mask {mask.shape[0]}, logprobs {logprobs.shape[0]}",
        )
    if tokens.dtype != TOKEN_DTYPE or mask.dtype != MASK_DTYPE or logprobs.dtype != LOGPROB_DTYPE:
        return (
            "invalid",
            f"dtypes must be int32/uint8/float32, got {tokens.dtype}/{mask.dtype}/{logprobs.dtype}",
        )
    turns = t.turns
    if native and _scan is not None and type(turns) is Turns:
        found = _scan(mask, logprobs, t.version_spans, turns.roles, turns.starts, turns.ends, 5)
        if found is not NotImplemented:
            return _scanned(t, found, n)
    # argmax and argmin stop at the first NaN and are the cheapest full passes numpy has
    if n and mask[mask.argmax()] > 1:
        return _MASK
    if not _rewards_finite(t):
        return _rewards_violation(t)
    if n and not (
        math.isfinite(logprobs[logprobs.argmax()]) and math.isfinite(logprobs[logprobs.argmin()])
    ):
        return _LOGPROBS
    if t.status not in STATUSES:
        return _status_violation(t)
    covered, prev_end = 0, 0
    for s in t.version_spans:
        if not prev_end <= s.start < s.end <= n or s.version < 0:
            return _span_violation(s, n)
        covered += int(np.count_nonzero(mask[s.start : s.end]))
        prev_end = s.end
    if covered != np.count_nonzero(mask):
        return _COVER
    if isinstance(turns, Turns):
        return _turn_columns_violation(turns) or _turns_violation(turns, n)
    prev_end = 0
    for turn in turns:
        if turn.role not in ROLES:
            return "bad_enum", f"unknown role {turn.role!r}"
        if not prev_end <= turn.start <= turn.end <= n:
            return "bad_span", f"turn {turn.role}[{turn.start}:{turn.end}] out of order or range"
        prev_end = turn.end
    return None


_MASK = "invalid", "loss_mask holds values other than 0 and 1"
_LOGPROBS = "non_finite", "logprobs hold NaN or infinity"
_COVER = "bad_span", "version spans do not cover every policy token"


def _rewards_finite(t: Trajectory) -> bool:
    return math.isfinite(t.reward) and all(math.isfinite(v) for v in t.rewards.values())


def _rewards_violation(t: Trajectory) -> tuple[str, str]:
    return "non_finite", f"reward {t.reward!r} or a reward component is not finite"


def _status_violation(t: Trajectory) -> tuple[str, str]:
    return "bad_enum", f"unknown status {t.status!r}"


def _span_violation(s: VersionSpan, n: int) -> tuple[str, str]:
    return "bad_span", f"version span {tuple(s)} out of order or outside [0, {n})"


def _scanned(t: Trajectory, found: tuple[int, int] | None, n: int) -> tuple[str, str] | None:
    """find_violation's answer from the C scan's (same checks, same order)."""
    check, index = found or (0, 0)
    if check == _native.MASK:
        return _MASK
    if not _rewards_finite(t):
        return _rewards_violation(t)
    if check == _native.LOGPROBS:
        return _LOGPROBS
    if t.status not in STATUSES:
        return _status_violation(t)
    if check == _native.SPAN:
        return _span_violation(t.version_spans[index], n)
    if check == _native.COVER:
        return _COVER
    turns = t.turns
    assert isinstance(turns, Turns)
    columns = _turn_columns_violation(turns)
    if columns is not None or not check:
        return columns
    if check == _native.ROLE:
        return _role_violation(index)
    return _turn_violation(turns, index, n)


def _role_violation(role: int) -> tuple[str, str]:
    return "bad_enum", f"unknown role number {role}"


def _turn_violation(turns: Turns, index: int, n: int) -> tuple[str, str]:
    if len(turns) > _FEW_TURNS:
        return "bad_span", f"turns out of order or outside [0, {n}]"
    start, end = int(turns.starts[index]), int(turns.ends[index])
    return "bad_span", f"turn [{start}:{end}] out of order or outside [0, {n}]"


_FEW_TURNS = 32


def _turn_columns_violation(turns: Turns) -> tuple[str, str] | None:
    roles, starts, ends, latency = turns.roles, turns.starts, turns.ends, turns.latency_s
    count = roles.shape[0] if roles.ndim == 1 else -1
    if (
        roles.dtype != TURN_ROLE_DTYPE
        or starts.dtype != TURN_POS_DTYPE
        or ends.dtype != TURN_POS_DTYPE
        or latency.dtype != TURN_LATENCY_DTYPE
    ):
        return "invalid", "turn columns must be uint8 roles, int32 starts and ends, float64 latency"
    if (
        count < 0
        or starts.shape != (count,)
        or ends.shape != (count,)
        or latency.shape != (count,)
        or len(turns.tool_names) not in (0, count)
    ):
        return "length_mismatch", "turn columns (roles, starts, ends, latency, tools) disagree"
    return None


def _turns_violation(turns: Turns, n: int) -> tuple[str, str] | None:
    """Roles and order of turn columns that :func:`_turn_columns_violation` passed."""
    roles, starts, ends = turns.roles, turns.starts, turns.ends
    count = roles.shape[0]
    if not count:
        return None
    if roles[roles.argmax()] >= len(ROLES):
        return _role_violation(int(roles.max()))
    if count <= _FEW_TURNS:  # cheaper in Python than in numpy, which costs microseconds per call
        prev_end = 0
        for i, (start, end) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
            if not prev_end <= start <= end <= n:
                return _turn_violation(turns, i, n)
            prev_end = end
        return None
    # starts[0] <= ends[0] <= starts[1] <= ... <= ends[-1], as one sequence
    bounds = np.empty(2 * count, TURN_POS_DTYPE)
    bounds[0::2] = starts
    bounds[1::2] = ends
    if bounds[0] < 0 or bounds[-1] > n or np.diff(bounds).min() < 0:
        return _turn_violation(turns, 0, n)
    return None


try:
    from pipeline.records import _contract_native as _native  # type: ignore[attr-defined]
except ImportError:  # installed without a C compiler: numpy alone
    _native = None

#: the C scan, where it is built and not turned off (``RLSTREAM_AVRO_NATIVE=0``)
_scan: Any = _native.scan if _native is not None and native_enabled() else None
