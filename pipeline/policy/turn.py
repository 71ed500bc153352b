"""What a policy turn gives back, and what episodes and the producer need of a policy:
rlstream's own engine (:class:`~pipeline.policy.server.PolicyServer`) or an inference
server (:class:`~pipeline.policy.remote.RemotePolicy`). Imports nothing heavy: a
configuration that names a policy is checked without loading JAX."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


def ends_turn(
    tokens: list[int], stop_tokens: set[int], stop_sequences: tuple[tuple[int, ...], ...]
) -> bool:
    """Whether the last of ``tokens`` ends a turn: a stop token, or the end of a stop
    sequence."""
    return tokens[-1] in stop_tokens or any(tuple(tokens[-len(s) :]) == s for s in stop_sequences)


@dataclass
class TurnResult:
    """Tokens the policy sampled for one turn, each with its log-probability and the
    policy version that sampled it. ``stopped`` is the stop token (or the last token of
    the stop sequence) that ended the turn, or None when it ran out of tokens or context."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stopped: int | None = None


class Policy(Protocol):
    """What episodes and the producer need of a policy: rlstream's engine on its thread
    (:class:`PolicyServer`) or an inference server
    (:class:`~pipeline.policy.remote.RemotePolicy`)."""

    @property
    def version(self) -> int: ...

    @property
    def max_len(self) -> int: ...

    @property
    def logprob_temperature(self) -> float: ...

    @property
    def shared_prompt_tokens(self) -> int: ...

    def room(self, slot: int) -> int: ...

    async def generate(
        self,
        slot: int,
        tokens: list[int],
        max_new_tokens: int,
        *,
        reset: bool = False,
        stream: int | None = None,
    ) -> TurnResult: ...

    def release(self, slot: int) -> None: ...

    def swap(self, state: Any, version: int) -> None: ...

    def start(self) -> Any: ...

    def stop(self) -> None: ...

    async def aclose(self) -> None: ...
