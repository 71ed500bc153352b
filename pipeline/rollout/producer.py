"""The rollout producer: C concurrent episodes on one asyncio loop, batched sampling,
records to Kafka, live weight reload and lag-aware admission control.

Episodes are started group by group (each task sampled ``group_size`` times, one record
per episode, keyed by group id). A slow environment only holds its own episode: the
policy server batches whatever turns are ready. Admission control (:class:`Gate`) stops
starting new groups while the trainer's consumer lag means new samples would arrive too
stale, and resumes when the lag drains.

The loop that starts episodes sleeps until something that could change its answer
happens: an episode ends (a slot and budget are freed), the lag is polled, the peers'
heartbeats are read, new weights are loaded, or the producer is stopped. Records are
written without blocking the loop: when the client's local queue is full the write waits
in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import confluent_kafka
from flax import nnx

from connectors.base import Environment, close_shared, env_name, make
from pipeline.errors import InvalidConfigError, InvalidTrajectoryError, ProducerFailedError
from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import rollout_topic
from pipeline.kafka.transport import TrajectoryWriter
from pipeline.kafka.weights import WeightsSubscriber
from pipeline.observe.prometheus import Sample
from pipeline.policy.hf_weights import initial_model
from pipeline.policy.remote import RemotePolicy, server_url
from pipeline.policy.sampler import DecodeEngine
from pipeline.policy.server import Policy, PolicyServer
from pipeline.policy.tokenizer import tokenizer_for
from pipeline.policy.turn import TurnResult
from pipeline.records.trajectory import Trajectory
from pipeline.rollout.admission import Gate
from pipeline.rollout.config import ProducerConfig
from pipeline.rollout.episode import GroupSlot, failed_trajectory, run_episode
from pipeline.rollout.exactness import Exactness
from pipeline.rollout.peers import Heartbeats, LagMonitor
from pipeline.rollout.status import prometheus_samples

log = logging.getLogger(__name__)


@dataclass
class ProducerStats:
    started: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    dropped: int = 0
    #: episodes that failed inside the producer (written as failed records)
    failed: int = 0
    #: episodes ended early, certain to arrive too stale (``admission.abort_stale``)
    aborted_stale: int = 0


class RolloutProducer:
    """Runs episodes until ``max_episodes`` or until stopped; see module docstring."""

    def __init__(
        self,
        cfg: ProducerConfig,
        kafka: KafkaConfig,
        on_progress: Callable[[RolloutProducer], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.kafka = kafka
        self.tokenizer = tokenizer_for(cfg.model.path)
        if cfg.model.vocab_size < self.tokenizer.vocab_size:
            raise InvalidConfigError("model vocabulary is smaller than the tokenizer's")
        model = initial_model(cfg.model, cfg.model_seed)
        stop_sequences = tuple(tuple(self.tokenizer.encode(s)) for s in cfg.stop_sequences)
        self.server: Policy
        url = server_url(cfg.policy)
        if url is None:
            engine = DecodeEngine(model, cfg.concurrency, cfg.sampling, swap_kv=cfg.swap_kv)
            self.server = PolicyServer(
                engine, self.tokenizer.stop_tokens, stop_sequences=stop_sequences
            )
        else:
            remote = RemotePolicy(
                url,
                cfg.model,
                cfg.sampling,
                self.tokenizer.stop_tokens,
                stop_sequences=stop_sequences,
                token_text=lambda i: self.tokenizer.decode([i]),
                models_dir=cfg.policy_models_dir,
                name_prefix=cfg.namespace,
                concurrency=cfg.concurrency,
                timeout_s=cfg.policy_timeout_s,
                wait_s=cfg.policy_wait_s,
            )
            if cfg.policy_models_dir is not None:  # the server starts from version 0 too
                remote.swap(nnx.state(model, nnx.Param), 0)
            self.server = remote
        self.writer = TrajectoryWriter(kafka, cfg.namespace)
        self.stats = ProducerStats()
        self.exactness = Exactness()
        #: when each episode in flight began (monotonic seconds)
        self._begun: dict[asyncio.Task[None], float] = {}
        #: episodes still playing (not writing their record yet): their group and the
        #: version of their first sampled token (None before it)
        self._playing: dict[asyncio.Task[None], tuple[str, int | None]] = {}
        self.stop_event = threading.Event()
        self.on_progress = on_progress
        self.weights: WeightsSubscriber | None = None
        if cfg.checkpoint_roots:
            self.weights = WeightsSubscriber(
                kafka,
                cfg.namespace,
                cfg.model,
                self.tokenizer.id,
                cfg.checkpoint_roots,
                self._swap,
                source=cfg.weights_source,
            )
        self._rng = random.Random(cfg.seed)
        self._env_name = env_name(cfg.env, cfg.env_kwargs)
        # with a schema registry: registered now, so a refused schema stops the start
        self.writer.route(self._env_name)
        self._tasks: Environment | None = None
        self._failures_in_a_row = 0
        self.last_failure = ""
        #: why the producer gave up (raised by ``run`` once everything is flushed)
        self.failure: ProducerFailedError | None = None
        self._started = time.monotonic()
        adm = cfg.admission
        self.gate = Gate(adm.max_staleness, adm.trainer_batch, cfg.group_size, cfg.sync_batch)
        #: set when something happened that may let a group start (see the module docstring)
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: the newest version handed to the policy (rlstream's engine applies it before
        #: its next decode step: an episode started now samples with it)
        self._handed = -1

    @property
    def version(self) -> int:
        return self.server.version

    def stop(self) -> None:
        self.stop_event.set()
        self._poke()

    def _poke(self) -> None:
        """Wake the loop that starts episodes (from any thread)."""
        loop, wake = self._loop, self._wake
        if loop is None or wake is None:
            return
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # the loop has closed
            pass

    def _swap(self, state: object, version: int) -> None:
        """New weights for the policy (from the weights thread); the versions behind, and
        synchronous mode's batch, change with them."""
        self.server.swap(state, version)
        self._handed = max(self._handed, version)
        self._poke()

    def samples(self) -> list[Sample]:
        """This producer's figures for Prometheus (read at scrape time)."""
        return prometheus_samples(self)

    def run(self) -> ProducerStats:
        """Run on a new event loop until done; flushes every finished record."""
        self.server.start()
        if self.weights is not None:
            self.weights.start()
            deadline = time.monotonic() + 30  # start from the latest announced weights
            while not (self.weights.caught_up.wait(0.1) or self.stop_event.is_set()):
                if time.monotonic() > deadline:
                    break
        try:
            asyncio.run(self._main())
        finally:
            stopped = self.stop_event.is_set()
            self.server.stop()
            if self.weights is not None:
                self.weights.stop()
            self.writer.flush(self.cfg.stop_timeout_s if stopped else None)
        if self.failure is not None:
            raise self.failure
        return self.stats

    async def _main(self) -> None:
        cfg = self.cfg
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        free = list(range(cfg.concurrency))
        running: set[asyncio.Task[None]] = set()
        members: list[GroupSlot] = []
        admission = asyncio.create_task(self._admission())
        progress = asyncio.create_task(self._progress())
        while not self.stop_event.is_set():
            if cfg.max_episodes is not None and self.stats.started >= cfg.max_episodes:
                break
            self._wake.clear()
            if cfg.admission.abort_stale and self._abort_stale(members):
                members = []
            if free and (members or self._may_start()):
                if not members:
                    members = self._new_group()
                    self.gate.started(len(members))
                slot = free.pop()
                task = asyncio.create_task(self._episode(members.pop(0), slot, free))
                running.add(task)
                task.add_done_callback(running.discard)
                self._begun[task] = time.monotonic()
                task.add_done_callback(self._begun.pop)
                self.stats.started += 1
                continue
            try:  # a second at most: a cause nobody wakes the loop for costs that, no more
                await asyncio.wait_for(self._wake.wait(), 1.0)
            except TimeoutError:
                pass
        await self._drain(running)
        progress.cancel()
        admission.cancel()
        await asyncio.gather(admission, progress, return_exceptions=True)  # heartbeat goodbye
        await close_shared()
        await self.server.aclose()

    async def _progress(self) -> None:
        """``on_progress`` once a second."""
        if self.on_progress is None:
            return
        while True:
            await asyncio.sleep(1.0)
            self.on_progress(self)

    def _may_start(self) -> bool:
        """Admission control (:class:`Gate`): may a new group start now?"""
        return self.gate.may_start(
            in_flight=self.in_flight,
            sent=self.writer.sent,
            version=max(self.version, self._handed),
            announced_version=None if self.weights is None else self.weights.announced,
        )

    def _abort_stale(self, members: list[GroupSlot]) -> bool:
        """End the episodes certain to arrive too stale: their first token is more than
        ``max_staleness`` versions older than weights this producer has loaded (verified
        weights only: an announcement alone never ends an episode), so the trainer, ahead
        of those, drops them. True when the group still being started is one of theirs
        (its other members would arrive without them: they are not started)."""
        loaded = max(self.version, self._handed)
        bound = self.cfg.admission.max_staleness
        if bound < 0:
            return False
        ended: list[str] = []
        for task, (gid, first) in list(self._playing.items()):
            if first is not None and loaded - first > bound:
                del self._playing[task]
                task.cancel()
                ended.append(gid)
        if not ended:
            return False
        self.stats.aborted_stale += len(ended)
        log.info(
            "aborted %d episodes certain to arrive too stale (weights v%d loaded)",
            len(ended),
            loaded,
        )
        return bool(members) and members[0].group_id in ended

    def paused_seconds(self) -> float:
        """Seconds admission control has held new episodes back so far (this producer's
        clock, a pause under way included)."""
        return sum(self.gate.paused_by().values())

    def paused_by(self) -> dict[str, float]:
        """:meth:`paused_seconds` by cause (see :data:`pipeline.rollout.admission.CAUSES`),
        rounded to the millisecond."""
        return {cause: round(s, 3) for cause, s in self.gate.paused_by().items()}

    def in_flight_ages(self) -> dict[str, float]:
        """How long the episodes in flight have run (s): median and oldest."""
        now = time.monotonic()
        ages = sorted(now - t for t in list(self._begun.values()))
        if not ages:
            return {"p50": 0.0, "max": 0.0}
        return {"p50": round(ages[len(ages) // 2], 3), "max": round(ages[-1], 3)}

    def running_seconds(self) -> float:
        return time.monotonic() - self._started

    @property
    def in_flight(self) -> int:
        st = self.stats
        return st.started - sum(st.finished.values()) - st.dropped - st.aborted_stale

    async def _drain(self, running: set[asyncio.Task[None]]) -> None:
        if running:
            _, pending = await asyncio.wait(
                set(running), timeout=self.cfg.grace_s if self.stop_event.is_set() else None
            )
            for t in pending:
                t.cancel()
            self.stats.dropped += len(pending)
            if pending:
                log.warning("dropped in-flight episodes=%d after grace", len(pending))
                await asyncio.gather(*pending, return_exceptions=True)

    def _new_group(self) -> list[GroupSlot]:
        if self._tasks is None:  # one instance draws every group's task
            self._tasks = make(self.cfg.env, **self.cfg.env_kwargs)
        task = self._tasks.sample_task(self._rng)
        gid = f"{self.cfg.producer_id}-{uuid.uuid4().hex[:12]}"
        g = self.cfg.group_size
        return [GroupSlot(gid, g, i, task) for i in range(g)]

    async def _episode(self, member: GroupSlot, slot: int, free: list[int]) -> None:
        """Play one episode and write its record. Whatever fails on the way (the
        episode itself, or a record that breaks the contract) still writes a record, a
        :func:`failed_trajectory`, so that its group stays complete and the episode is
        counted: nothing stays in flight."""
        status = "env_error"
        me = asyncio.current_task()
        assert me is not None

        def first_turn(turn: TurnResult) -> None:
            if me in self._playing and self._playing[me][1] is None and turn.versions:
                self._playing[me] = (member.group_id, turn.versions[0])

        self._playing[me] = (member.group_id, None)
        try:
            try:
                env = make(self.cfg.env, **self.cfg.env_kwargs)
                t = await run_episode(
                    env,
                    member,
                    self.server,
                    slot,
                    self.tokenizer,
                    self.cfg.limits,
                    self.cfg.producer_id,
                    first_turn,
                )
            finally:
                self._playing.pop(me, None)
                free.append(slot)
                self._poke()
            self._check_exactness(t)
            try:
                await self._write(t)
                status = t.status
            except InvalidTrajectoryError as e:  # e.g. a policy that sampled NaN
                await self._failed(member, f"record refused: {e}")
        except asyncio.CancelledError:  # dropped after the grace period, or aborted: counted
            raise
        except Exception as e:
            log.warning("episode failed group=%s error=%r", member.group_id, e)
            await self._failed(member, f"{type(e).__name__}: {e}")
        self.stats.finished[status] += 1
        self._note_outcome(status)
        self._poke()

    async def _write(self, t: Trajectory) -> None:
        """Write a record; when the client's local queue is full, wait for room in a
        thread, not on the event loop (the other episodes go on meanwhile)."""
        if not self.writer.write(t, wait=False):
            await asyncio.to_thread(self.writer.write, t)

    def _check_exactness(self, t: Trajectory) -> None:
        """Count whether the record's tokens are those of its conversation rendered at
        once (:mod:`pipeline.rollout.exactness`); the first divergent context is logged."""
        try:
            diverges = self.exactness.add(self.tokenizer, t.tokens, t.loss_mask, t.turns)
        except Exception as e:  # a check never costs an episode
            log.warning("record %s not checked for exactness: %r", t.trajectory_id, e)
            return
        if diverges and self.exactness.divergent_context == 1:
            log.warning(
                "record %s: its context tokens are not those of its text rendered at once "
                "(counted as divergent_context in the status)",
                t.trajectory_id,
            )

    async def _failed(self, member: GroupSlot, error: str) -> None:
        self.stats.failed += 1
        self.last_failure = error[:500]
        record = failed_trajectory(
            member, self._env_name, self.tokenizer.id, self.cfg.producer_id, error
        )
        try:
            await self._write(record)
        except Exception as e:  # counted, and the run of failures stops the producer
            log.error("failed episode's record not written group=%s error=%r", member.group_id, e)

    def _note_outcome(self, status: str) -> None:
        """Stop the producer when the last ``max_consecutive_failures`` episodes all
        failed (environment errors, time-outs, failures inside the producer)."""
        if status in ("ok", "truncated"):
            self._failures_in_a_row = 0
            return
        self._failures_in_a_row += 1
        limit = self.cfg.max_consecutive_failures
        if limit and self._failures_in_a_row >= limit and self.failure is None:
            finished = dict(self.stats.finished)
            self.failure = ProducerFailedError(
                f"the last {self._failures_in_a_row} episodes all failed (finished so far "
                f"by status: {finished}; failures inside the producer: {self.stats.failed}); "
                f"last error: {self.last_failure or 'see the log'}"
            )
            self.stop_event.set()

    async def _admission(self) -> None:
        """Every ``poll_s``: the trainer's lag, then this producer's heartbeat out and
        its peers' in."""
        adm = self.cfg.admission
        if adm.max_staleness < 0:
            return
        monitor = LagMonitor(
            self.kafka,
            rollout_topic(self.cfg.namespace, self._env_name),
            f"{self.cfg.namespace}.trainer",
        )
        heartbeats = Heartbeats(
            self.kafka,
            self.cfg.namespace,
            self.cfg.producer_id,
            adm.poll_s,
            adm.heartbeat_timeout_s,
        )
        try:
            while True:
                try:
                    settled = self.writer.settled()
                    heartbeats.mark_poll()
                    self.gate.polled(await asyncio.to_thread(monitor.lag), settled)
                    self._poke()
                except confluent_kafka.KafkaException as e:  # e.g. coordinator loading
                    log.warning("lag unknown, keeping the last value: %s", e)
                try:
                    # Peers count a record in their lag poll once it is acknowledged:
                    # until then it counts as in flight here.
                    in_flight, settled = self.in_flight, self.writer.settled()
                    peers, unpolled = await asyncio.to_thread(
                        self._exchange,
                        heartbeats,
                        in_flight + self.writer.sent - settled,
                        settled,
                        self.gate.share,
                    )
                    self.gate.heard(peers, unpolled, in_flight, heartbeats.ready)
                    self._poke()
                except confluent_kafka.KafkaException as e:
                    log.warning("heartbeats not exchanged, keeping the last peers: %s", e)
                    self.gate.peers_known = self.gate.peers_known or heartbeats.ready
                await asyncio.sleep(adm.poll_s)
        except asyncio.CancelledError:
            pass
        finally:
            await asyncio.to_thread(monitor.close)
            await asyncio.to_thread(heartbeats.leave)

    @staticmethod
    def _exchange(
        heartbeats: Heartbeats, in_flight: int, sent: int, share: int
    ) -> tuple[dict[str, int], int]:
        heartbeats.beat(in_flight, sent, share)
        heartbeats.read(timeout_s=5.0)
        return heartbeats.live(), heartbeats.unpolled()
