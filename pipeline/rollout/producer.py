"""The rollout producer: C concurrent episodes on one asyncio loop, batched sampling,
records to Kafka, live weight reload and lag-aware admission control.

Episodes are started group by group (each task sampled ``group_size`` times, one record
per episode, keyed by group id). A slow environment only holds its own episode: the
policy server batches whatever turns are ready. Admission control stops starting new
groups while the trainer's consumer lag means new samples would arrive too stale, and
resumes when the lag drains.
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

from connectors import stats as connector_stats
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
from pipeline.records.trajectory import Trajectory
from pipeline.rollout.admission import CAUSES, JOIN_ROUNDS, Heartbeats, LagMonitor, decide
from pipeline.rollout.config import ProducerConfig
from pipeline.rollout.episode import GroupSlot, failed_trajectory, run_episode
from pipeline.rollout.exactness import Exactness

log = logging.getLogger(__name__)


@dataclass
class ProducerStats:
    started: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    dropped: int = 0
    paused: bool = False
    #: seconds admission control held new episodes back, by cause
    #: (:data:`pipeline.rollout.admission.CAUSES`), up to the last change of cause (see
    #: :meth:`RolloutProducer.paused_by` for the pause under way)
    paused_by: dict[str, float] = field(default_factory=dict)
    #: the cause of the pause under way ("" when none), and since when (monotonic s)
    cause: str = ""
    cause_since: float = 0.0
    lag: int = 0
    #: synchronous mode: waiting for the trainer's next version
    waiting: bool = False
    #: episodes that failed inside the producer (written as failed records)
    failed: int = 0
    #: episodes in flight this producer allows itself (its share of the budget)
    share: int = 0
    #: live other producers of the namespace, and their episodes in flight
    peers: int = 0
    peers_in_flight: int = 0
    #: versions announced but not (yet) sampled with here
    behind: int = 0


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
                self.server.swap,
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
        self._sync_version = 0
        self._sync_started = 0
        self._started = time.monotonic()
        self._settled_at_poll = 0  # records settled when the last lag poll began
        self._peers: dict[str, int] = {}  # live peers and their episodes in flight
        self._peers_unpolled = 0  # records the peers wrote since the last lag poll
        #: no group starts before the peers are known (the heartbeats read to the end of
        #: the log an interval after this producer's first), so that producers starting
        #: at the same moment hear of each other first
        self._peers_known = False
        #: heartbeat rounds since the peers became known, and the episodes in flight this
        #: producer announced in its last heartbeat: for its first ``JOIN_ROUNDS`` rounds a
        #: producer holds at most one group more than it announced, so that a peer that
        #: started at the same moment (and is not heard of yet) never finds it far beyond
        #: its last heartbeat
        self._rounds_known = 0
        self._announced = 0

    @property
    def version(self) -> int:
        return self.server.version

    def stop(self) -> None:
        self.stop_event.set()

    def samples(self) -> list[Sample]:
        """This producer's figures for Prometheus (read at scrape time)."""
        st, w = self.stats, self.writer
        finished = dict(st.finished)
        done = sum(finished.values())
        out = [
            Sample(
                "rlstream_producer_episodes_total",
                n,
                "counter",
                "episodes finished, by status (ok, truncated, timeout, env_error)",
                {"status": status},
            )
            for status, n in sorted(finished.items())
        ]
        out += [
            Sample(
                "rlstream_producer_episodes_in_flight",
                st.started - done - st.dropped,
                help="episodes running now",
            ),
            Sample(
                "rlstream_producer_trajectories_per_second",
                done / max(1e-9, time.monotonic() - self._started),
                help="episodes finished per second since start",
            ),
            Sample("rlstream_producer_records_sent_total", w.sent, "counter", "records produced"),
            Sample(
                "rlstream_producer_records_delivered_total",
                w.delivered,
                "counter",
                "records acknowledged by Kafka",
            ),
            Sample(
                "rlstream_producer_delivery_failures_total",
                w.failed,
                "counter",
                "records Kafka did not acknowledge",
            ),
            Sample(
                "rlstream_producer_policy_version", self.version, help="policy version sampling now"
            ),
            Sample(
                "rlstream_producer_lag_records",
                st.lag,
                help="records not yet read by the trainer group (admission control's view)",
            ),
            Sample("rlstream_producer_paused", int(st.paused), help="1 while admission holds back"),
            Sample(
                "rlstream_producer_shared_prompt_tokens_total",
                self.server.shared_prompt_tokens,
                "counter",
                "prompt tokens copied from another conversation's cache instead of prefilled",
            ),
            Sample(
                "rlstream_producer_paused_seconds_total",
                self.paused_seconds(),
                "counter",
                "seconds held back by admission control",
            ),
        ]
        if self.weights is not None:
            out += [
                Sample(
                    "rlstream_producer_weights_refused_total",
                    n,
                    "counter",
                    "weight announcements refused, by reason",
                    {"reason": reason},
                )
                for reason, n in sorted(dict(self.weights.refused).items())
            ]
            out.append(
                Sample(
                    "rlstream_producer_weights_loaded_total",
                    self.weights.accepted,
                    "counter",
                    "weight announcements loaded",
                )
            )
        for key, n in sorted(connector_stats.snapshot().items()):
            connector, _, event = key.partition("/")
            out.append(
                Sample(
                    "rlstream_connector_events_total",
                    n,
                    "counter",
                    "connector events (retries, timeouts, restarts, tool calls ...)",
                    {"connector": connector, "event": event},
                )
            )
        return out

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
        free = list(range(cfg.concurrency))
        running: set[asyncio.Task[None]] = set()
        members: list[GroupSlot] = []
        admission = asyncio.create_task(self._admission())
        last_progress = time.monotonic()
        while not self.stop_event.is_set():
            if cfg.max_episodes is not None and self.stats.started >= cfg.max_episodes:
                break
            if free and not (members == [] and (not self._admit() or self._sync_full())):
                if not members:
                    members = self._new_group()
                    self._sync_started += len(members)
                slot = free.pop()
                task = asyncio.create_task(self._episode(members.pop(0), slot, free))
                running.add(task)
                task.add_done_callback(running.discard)
                self._begun[task] = time.monotonic()
                task.add_done_callback(self._begun.pop)
                self.stats.started += 1
                continue
            await asyncio.sleep(0.01)
            if self.on_progress and time.monotonic() - last_progress > 1.0:
                last_progress = time.monotonic()
                self.on_progress(self)
        await self._drain(running)
        admission.cancel()
        await asyncio.gather(admission, return_exceptions=True)  # its heartbeat goodbye
        await close_shared()
        await self.server.aclose()

    def _admit(self) -> bool:
        """Admission control (:mod:`pipeline.rollout.admission`): may a new group start
        now? The trainer's unread records, the ones written since the lag was polled, and
        the episodes in flight here and at every live peer stay within the budget."""
        adm = self.cfg.admission
        if adm.max_staleness < 0:
            return True
        if not self._peers_known:
            return False
        st = self.stats
        in_flight = self.in_flight
        # Versions the trainer is ahead of the weights sampled here (one is loading, or
        # could not be) make an episode started now that much older when trained.
        behind = 0 if self.weights is None else max(0, self.weights.announced - self.version)
        st.behind = behind
        d = decide(
            budget=max(0, adm.max_staleness - behind) * adm.trainer_batch,
            group_size=self.cfg.group_size,
            lag=st.lag,
            # The polled lag counts the records Kafka held when the poll began: those
            # this producer wrote that were not acknowledged by then count too (a record
            # written is not in the high watermark until the cluster acknowledges it),
            # or a slow poll or a slow broker would let it start groups on a low figure.
            unpolled=self.writer.sent - self._settled_at_poll + self._peers_unpolled,
            own_in_flight=in_flight,
            peers=self._peers,
            announced=self._announced if self._rounds_known < JOIN_ROUNDS else None,
        )
        st.share, st.peers, st.peers_in_flight = d.share, d.peers, sum(self._peers.values())
        paused = not d.admit
        if paused != st.paused:
            log.debug(
                "admission %s lag=%d in_flight=%d peers=%d peers_in_flight=%d share=%d",
                "paused" if paused else "resumed",
                st.lag,
                in_flight,
                d.peers,
                st.peers_in_flight,
                d.share,
            )
        now = time.monotonic()
        if d.cause != st.cause:
            if st.cause:
                st.paused_by[st.cause] = st.paused_by.get(st.cause, 0.0) + now - st.cause_since
            st.cause, st.cause_since = d.cause, now
        st.paused = paused
        return not paused

    def paused_seconds(self) -> float:
        """Seconds admission control has held new episodes back so far (this producer's
        clock, a pause under way included)."""
        return sum(self._paused_by().values())

    def paused_by(self) -> dict[str, float]:
        """:meth:`paused_seconds` by cause (see :data:`pipeline.rollout.admission.CAUSES`),
        rounded to the millisecond."""
        return {cause: round(s, 3) for cause, s in self._paused_by().items()}

    def _paused_by(self) -> dict[str, float]:
        st = self.stats
        out = {cause: st.paused_by.get(cause, 0.0) for cause in CAUSES}
        if st.cause:
            out[st.cause] += time.monotonic() - st.cause_since
        return out

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
        return st.started - sum(st.finished.values()) - st.dropped

    def _sync_full(self) -> bool:
        """Synchronous mode: this version's batch is started; wait for the next one."""
        if self.cfg.sync_batch is None:
            return False
        if self.version != self._sync_version:
            self._sync_version, self._sync_started = self.version, 0
        self.stats.waiting = self._sync_started >= self.cfg.sync_batch
        return self.stats.waiting

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
                )
            finally:
                free.append(slot)
            self._check_exactness(t)
            try:
                self.writer.write(t)
                status = t.status
            except InvalidTrajectoryError as e:  # e.g. a policy that sampled NaN
                self._failed(member, f"record refused: {e}")
        except asyncio.CancelledError:  # dropped after the grace period: counted there
            raise
        except Exception as e:
            log.warning("episode failed group=%s error=%r", member.group_id, e)
            self._failed(member, f"{type(e).__name__}: {e}")
        self.stats.finished[status] += 1
        self._note_outcome(status)

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

    def _failed(self, member: GroupSlot, error: str) -> None:
        self.stats.failed += 1
        self.last_failure = error[:500]
        record = failed_trajectory(
            member, self._env_name, self.tokenizer.id, self.cfg.producer_id, error
        )
        try:
            self.writer.write(record)
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
                    self.stats.lag = await asyncio.to_thread(monitor.lag)
                    self._settled_at_poll = settled
                except confluent_kafka.KafkaException as e:  # e.g. coordinator loading
                    log.warning("lag unknown, keeping the last value: %s", e)
                try:
                    # Peers count a record in their lag poll once it is acknowledged:
                    # until then it counts as in flight here.
                    in_flight, settled = self.in_flight, self.writer.settled()
                    self._peers, self._peers_unpolled = await asyncio.to_thread(
                        self._exchange,
                        heartbeats,
                        in_flight + self.writer.sent - settled,
                        settled,
                        self.stats.share,
                    )
                    self._announced = in_flight
                    self._rounds_known += self._peers_known
                except confluent_kafka.KafkaException as e:
                    log.warning("heartbeats not exchanged, keeping the last peers: %s", e)
                self._peers_known = self._peers_known or heartbeats.ready
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
