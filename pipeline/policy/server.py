"""Continuous batching of policy turns for many concurrent episodes.

Episodes (asyncio tasks) ask for a turn with ``await server.generate(slot, tokens)``; one
background thread owns the :class:`DecodeEngine` and, at every decode step, advances all
episodes that are generating in one batched forward pass. New requests join the batch at
the next step, so a slow environment never holds up the others, and an idle server waits
at most ``max_wait_s`` to gather a batch. New weights are swapped in between steps.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.observe.telemetry import tracer
from pipeline.policy.sampler import DecodeEngine
from pipeline.policy.turn import Policy, TurnResult, ends_turn

__all__ = ["Policy", "PolicyServer", "TurnResult"]

log = logging.getLogger(__name__)


@dataclass
class _Request:
    slot: int
    tokens: list[int]
    max_new_tokens: int
    future: asyncio.Future[TurnResult]
    loop: asyncio.AbstractEventLoop
    reset: bool
    stream: int | None = None
    result: TurnResult = field(default_factory=TurnResult)


class PolicyServer:
    """Owns the decode engine on one thread; ``generate`` is safe from any event loop."""

    def __init__(
        self,
        engine: DecodeEngine,
        stop_tokens: set[int],
        max_wait_s: float = 0.002,
        stop_sequences: tuple[tuple[int, ...], ...] = (),
    ) -> None:
        self.engine = engine
        self.stop_tokens = stop_tokens
        self.stop_sequences = tuple(s for s in stop_sequences if s)
        self.max_wait_s = max_wait_s
        self._inbox: queue.Queue[_Request] = queue.Queue()
        self._swap: tuple[Any, int] | None = None
        self._swap_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="policy", daemon=True)
        self.steps = 0
        self.batch_sizes = 0
        self.step_s: list[float] = []
        #: per swap: (version, wall time it took effect, seconds the swap itself took,
        #: seconds of the first decode step after it: None when applied while idle)
        self.swaps: list[tuple[int, float, float, float | None]] = []
        self.error: BaseException | None = None

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def max_len(self) -> int:
        """Tokens one conversation may hold."""
        return int(self.engine.cfg.max_len)

    @property
    def logprob_temperature(self) -> float:
        """The temperature recorded log-probabilities are taken at."""
        return self.engine.sampling.logprob_temperature

    @property
    def shared_prompt_tokens(self) -> int:
        """Prompt tokens copied from another conversation's cache instead of prefilled."""
        return int(self.engine.shared_prompt_tokens)

    def room(self, slot: int) -> int:
        """Tokens the slot's conversation may still take."""
        return int(self.engine.room(slot))

    async def aclose(self) -> None:
        """Nothing to close on the episodes' event loop (the engine has its own thread)."""

    def start(self) -> PolicyServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    async def generate(
        self,
        slot: int,
        tokens: list[int],
        max_new_tokens: int,
        *,
        reset: bool = False,
        stream: int | None = None,
    ) -> TurnResult:
        """Append ``tokens`` to the slot's conversation (after clearing it if ``reset``,
        as conversation ``stream``: see :meth:`DecodeEngine.reset`) and sample one turn of
        at most ``max_new_tokens``."""
        if self.error is not None:
            raise RuntimeError("the policy thread failed") from self.error
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[TurnResult] = loop.create_future()
        self._inbox.put(_Request(slot, tokens, max_new_tokens, fut, loop, reset, stream))
        return await fut

    def release(self, slot: int) -> None:
        """Forget an episode whose task was cancelled while it was generating."""
        self._inbox.put(_Request(slot, [], 0, None, None, True))  # type: ignore[arg-type]

    def swap(self, state: Any, version: int) -> None:
        """Use these parameters from the next decode step on."""
        with self._swap_lock:
            self._swap = (state, version)

    # ---- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        active: dict[int, _Request] = {}
        try:
            while not self._stop.is_set():
                self._take(active)
                swapped = self._apply_swap()
                if not active:
                    if swapped is not None:  # applied while idle: no step stalled for it
                        self.swaps.append((*swapped, None))
                    continue
                t0 = time.perf_counter()
                start_ns = time.time_ns()
                out = self.engine.step(list(active))
                took = time.perf_counter() - t0
                tracer().record(
                    "policy_forward",
                    start_ns,
                    start_ns + int(took * 1e9),
                    "policy",
                    {"rows": len(active), "version": self.engine.version},
                )
                self.step_s.append(took)
                del self.step_s[:-1000]
                if swapped is not None:
                    self.swaps.append((*swapped, took))
                self.steps += 1
                self.batch_sizes += len(out)
                for slot, (token, logp, version) in out.items():
                    req = active[slot]
                    r = req.result
                    r.tokens.append(token)
                    r.logprobs.append(logp)
                    r.versions.append(version)
                    done = ends_turn(r.tokens, self.stop_tokens, self.stop_sequences)
                    if done:
                        r.stopped = token
                    if done or len(r.tokens) >= req.max_new_tokens or self.engine.room(slot) < 1:
                        del active[slot]
                        req.loop.call_soon_threadsafe(_resolve, req.future, r)
        except BaseException as e:  # surfaced to every waiting episode
            log.exception("policy thread failed")
            self.error = e
            for req in active.values():
                req.loop.call_soon_threadsafe(_fail, req.future, e)

    def _take(self, active: dict[int, _Request]) -> None:
        """Admit new requests: all that are waiting when some episodes are generating;
        when idle, the first one to come and whatever follows within ``max_wait_s``."""
        if active:
            while True:
                try:
                    self._admit(self._inbox.get_nowait(), active)
                except queue.Empty:
                    return
        while not self._stop.is_set():
            try:
                self._admit(self._inbox.get(timeout=0.1), active)
                break
            except queue.Empty:
                if self._swap is not None:  # idle: take new weights now, not at next work
                    return
                continue
        deadline = time.monotonic() + self.max_wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                self._admit(self._inbox.get(timeout=left), active)
            except queue.Empty:
                return

    def _admit(self, req: _Request, active: dict[int, _Request]) -> None:
        if req.future is None:  # release
            active.pop(req.slot, None)
            self.engine.reset(req.slot)
            return
        if req.reset:
            self.engine.reset(req.slot, req.stream)
        if len(req.tokens) > self.engine.room(req.slot):  # never past the context
            req.loop.call_soon_threadsafe(_resolve, req.future, req.result)
            return
        self.engine.append(req.slot, req.tokens)
        if req.max_new_tokens <= 0 or self.engine.room(req.slot) < 1:
            req.loop.call_soon_threadsafe(_resolve, req.future, req.result)
            return
        active[req.slot] = req

    def _apply_swap(self) -> tuple[int, float, float] | None:
        with self._swap_lock:
            swap, self._swap = self._swap, None
        if swap is None:
            return None
        start = time.perf_counter()
        with tracer().span("weights_swap", "policy", version=swap[1]):
            self.engine.swap(*swap)
        log.info("policy swapped version=%d", swap[1])
        return swap[1], time.time(), time.perf_counter() - start


def _resolve(fut: asyncio.Future[TurnResult], r: TurnResult) -> None:
    if not fut.done():
        fut.set_result(r)


def _fail(fut: asyncio.Future[TurnResult], e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(RuntimeError(f"policy thread failed: {e}"))
