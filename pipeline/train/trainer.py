"""The trainer: a member of consumer group ``<ns>.trainer`` that filters, batches and
trains, and checkpoints so that every trajectory is trained at most once and none is lost.

Per record: settled-before-restart records are skipped; :mod:`pipeline.train.intake` judges
the rest (the staleness filter drops a record from its headers alone when ``version -
min_version > max_staleness``; records that do not decode or break the training contract
go to ``<ns>.deadletter``, whatever the failure); the rest wait in the group buffer until
their GRPO group is complete (a repeated or foreign member is refused there). When the
trainer is far behind, a whole range of a partition that is certainly stale (appended
before the version that is ``max_staleness`` steps old was announced, by the broker's
clock) is skipped with one seek.

Every ``publish_every`` steps, in this order: the ledger lines are durable, an orbax
checkpoint (train state, version, positions) is durable, the positions are committed to
Kafka, the parameters are saved for producers and announced on ``<ns>.weights``.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import confluent_kafka
import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from pipeline.errors import (
    InvalidConfigError,
    RecordDecodeError,
    RegistryUnavailableError,
    TrainingDivergedError,
)
from pipeline.kafka.client import KafkaConfig, WaitBudget, close_within
from pipeline.kafka.message import Record
from pipeline.kafka.topics import ROLLOUTS, env_of
from pipeline.kafka.transport import Coordinates
from pipeline.observe.prometheus import Sample
from pipeline.observe.telemetry import metric, span
from pipeline.observe.tensorboard import ScalarWriter, flatten
from pipeline.policy.hf_weights import initial_model
from pipeline.policy.model import all_finite
from pipeline.policy.tokenizer import tokenizer_for
from pipeline.records.ledger import Ledger, member_dir
from pipeline.records.trajectory import Trajectory, tool_call_rate, tool_error_rate
from pipeline.train.advantages import zero_variance
from pipeline.train.batching import (
    GroupBuffer,
    GroupQueue,
    Refused,
    all_rewards,
    assemble,
    bucket_for,
    group_rewards,
    pack,
    row_choices,
    rows_to_pack,
)
from pipeline.train.config import TrainerConfig
from pipeline.train.contract import RecordContract
from pipeline.train.grpo import init_state, make_train_step
from pipeline.train.intake import DeadLetters, HeldRecords, RecordJudge
from pipeline.train.members import Members, Watchdog
from pipeline.train.mesh import batch_sharding, make_mesh, state_shardings
from pipeline.train.parity import check
from pipeline.train.positions import PositionTracker
from pipeline.train.publish import WeightsPublisher
from pipeline.train.reading import PartitionReading, fatal
from pipeline.train.samples import trainer_samples
from pipeline.train.stale import StaleRanges

log = logging.getLogger(__name__)


class Trainer(PartitionReading):
    def __init__(
        self,
        cfg: TrainerConfig,
        kafka: KafkaConfig | None,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        source: Any = None,
    ) -> None:
        """``source``: train from a recording (:class:`pipeline.kafka.replay.RecordingSource`)
        instead of Kafka; then nothing is committed, dead-lettered or announced (the
        ledger still says what was dropped, and weights are still saved), no clock
        decides anything, and the run ends when the recording does."""
        self.cfg = cfg
        self.kafka = kafka
        self.on_step = on_step
        self.stop_event = threading.Event()
        #: a group member's guard against a stalled group (None alone)
        self.watchdog: Watchdog | None = None
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.members = Members(cfg.members, cfg.member_index, cfg.coordinator)  # before JAX runs
        #: this member's own files (ledger, metrics); checkpoints and weights are shared
        self.own_dir = member_dir(cfg.run_dir, self.members.index)
        self.own_dir.mkdir(parents=True, exist_ok=True)
        self.tx = cfg.grpo.optimizer()
        self.tokenizer = tokenizer_for(cfg.model.path)
        self.mesh = make_mesh(cfg.fsdp, cfg.tensor_parallel)
        self.members.check_mesh(self.mesh)
        self.graphdef, state = init_state(
            initial_model(cfg.model, cfg.seed, training=True),
            self.tx,
            reference=cfg.grpo.kl_coef > 0,
            critic=cfg.grpo.advantage == "gae",
            lora=cfg.lora,
            seed=cfg.seed,
        )
        shardings = state_shardings(state, self.mesh)
        self.state = self.members.put(state, shardings)
        del state
        self.batch_sharding = batch_sharding(self.mesh)
        self.train_step = make_train_step(
            self.graphdef,
            cfg.grpo,
            self.tx,
            donate=True,
            shardings=(shardings, self.batch_sharding),
            lora=cfg.lora,
        )
        #: this member's groups and rows of a global batch
        self.quota = cfg.groups_per_batch // self.members.count
        #: the row counts of this member's packed batches: multiples of what splits a
        #: group's batch evenly into minibatches, micro-batches and data-parallel devices
        split = cfg.grpo.minibatches * math.lcm(cfg.grpo.microbatches, self.mesh.shape["fsdp"])
        self.row_choices = row_choices(
            cfg.rows // self.members.count, split // math.gcd(split, self.members.count)
        )
        self.ledger = Ledger(self.own_dir / "ledger.jsonl")
        self.metrics_path = self.own_dir / "metrics.jsonl"
        self.scalars = ScalarWriter(self.own_dir / "tensorboard")  # the same rows, for TensorBoard
        self.tracker = PositionTracker()
        self.version = 0
        self.version_times: dict[int, int] = {}
        late = (lambda g: group_rewards(g, cfg.grpo)) if cfg.late_members == "train" else None
        self.buffer = GroupBuffer(cfg.max_buffered, cfg.group_timeout_s, late_rewards=late)
        self.ready = GroupQueue(cfg.env_weights)
        self.drops: Counter[str] = Counter()
        #: groups trained without all their members, at their deadline; members that came
        #: after and were trained alone (``late_members: train``)
        self.partial_groups = 0
        self.late_members = 0
        self.drops_by_env: Counter[str] = Counter()
        self.stale_ranges = StaleRanges(kafka)
        self.nonfinite_steps = 0  # steps not applied (non-finite loss or gradient)
        self.nonfinite_in_a_row = 0
        contract = RecordContract(
            min(self.tokenizer.vocab_size, cfg.model.vocab_size),
            cfg.max_abs_reward,
            cfg.min_logprob,
        )
        #: stale tokens are masked, not their trajectories dropped (``stale_tokens``)
        self.mask_stale = cfg.stale_tokens == "mask"
        self.judge = RecordJudge(
            contract,
            self.tokenizer.id,
            cfg.max_record_bytes,
            cfg.grpo.temperature,
            whole=self.mask_stale,
        )
        #: records waiting for the schema registry to answer for their schema id
        self.held = HeldRecords(cfg.max_buffered)
        self.reading_paused = False  # fetching paused while held records are at their limit
        self.commit_failures = 0
        self.consumer_renewals = 0  # consumers replaced after a fatal error
        #: why the consumer failed for good (a fatal error), until a new one replaces it
        self.consumer_failed: str | None = None
        #: the last checkpoint's offsets, to commit (again, after a failure)
        self._uncommitted: list[Any] = []
        #: the offsets of the commit awaiting its answer
        self._committing: list[Any] | None = None
        self.trained = 0  # samples trained by this process
        self.last_metrics: dict[str, Any] = {}  # the latest step's metrics row
        self.started_at = time.monotonic()
        #: seconds spent per phase: consume, intake (filter, decode), assemble, step,
        #: checkpoint (ledger, orbax, commit, announcement)
        self.timers: dict[str, float] = defaultdict(float)
        self._last_checkpoint = self._last_step = time.monotonic()
        self.ckpt = ocp.CheckpointManager(
            (cfg.run_dir / "checkpoints").absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints, create=True),
        )
        self._restore(recording=source is not None)
        self.source = source
        if source is not None:
            self.consumer = source
            self.consumer.subscribe([], on_assign=self._on_assign, on_revoke=self._on_revoke)
            self.producer: Any = None
            self.dead_letters = DeadLetters(None, cfg.namespace, cfg.trainer_id)
            self.publisher = WeightsPublisher(
                cfg, None, self.tokenizer.id, lead=self.members.lead
            )  # saved, never announced
            return
        if kafka is None:
            raise InvalidConfigError("a trainer needs a Kafka cluster or a recording")
        self.consumer = self._new_consumer()
        # subscribed when training starts (after the warm-up compiles), so that the group
        # never waits on, or hands partitions to, a member that is not reading yet
        self._pattern = (
            "^" + cfg.namespace.replace("-", "\\-") + ROLLOUTS.replace(".", "\\.") + ".*"
        )
        self.producer = kafka.producer()
        self.dead_letters = DeadLetters(self.producer, cfg.namespace, cfg.trainer_id)
        lead = self.members.lead
        self.publisher = WeightsPublisher(
            cfg,
            self.producer if lead else None,
            self.tokenizer.id,
            lead,
            # checkpoint files are not worth compressing
            kafka.producer(**{"compression.type": "none"})
            if lead and cfg.weights_to_cluster
            else None,
        )

    @property
    def deadlettered(self) -> int:
        return self.dead_letters.count

    @property
    def deadletter_failures(self) -> int:
        return self.dead_letters.failures

    # ---- restore and positions --------------------------------------------------------

    def _restore(self, recording: bool) -> None:
        step = self.ckpt.latest_step()
        if step is None:
            # lines of a start that died before its first checkpoint describe nothing
            # durable: that work is done again
            removed = self.ledger.truncate_after(0)
            if removed:
                log.info("no checkpoint yet: ledger_lines_removed=%d", removed)
            return
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self.state)
        try:
            restored = self.ckpt.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
                ),
            )
        except ValueError as e:
            if "do not match" not in str(e):
                raise
            raise InvalidConfigError(
                f"checkpoint {step} in {self.cfg.run_dir / 'checkpoints'} holds a training "
                "state of another structure than this trainer's (the model, lora or "
                "advantage settings differ from the run that wrote it): train with that "
                "run's settings or into a new run directory"
            ) from None
        self.state = restored["state"]
        meta = restored["meta"]
        group = meta.get("members", [{"seq": meta["seq"], "positions": meta["positions"]}])
        if len(group) != self.members.count:
            raise InvalidConfigError(
                f"the checkpoint in {self.cfg.run_dir / 'checkpoints'} was written by a trainer "
                f"group of {len(group)} member(s): restart it with members={len(group)}, or "
                "train into a new run directory"
            )
        self.version = int(meta["version"])
        self.version_times = {int(k): int(v) for k, v in meta["version_times"].items()}
        # every member's positions: whichever partitions this member is given, the
        # checkpoint decides where it resumes (each member of a recording has its own
        # share of every partition)
        positions: dict[str, Any] = {}
        for member in [group[self.members.index]] if recording else group:
            positions.update(member["positions"])
        self.tracker = PositionTracker.from_json(positions)
        removed = self.ledger.truncate_after(int(group[self.members.index]["seq"]))
        log.info(
            "restored checkpoint step=%d version=%d ledger_lines_removed=%d",
            step,
            self.version,
            removed,
        )

    # ---- the loop ----------------------------------------------------------------------

    def stop(self) -> None:
        self.stop_event.set()

    def _beat(self, doing: str) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(doing)

    def run(self) -> int:
        """Train until ``max_steps`` or until stopped; returns the final step."""
        last_skip_check = 0.0
        step = int(self.state.step)
        if self.members.many:
            self.watchdog = Watchdog(
                self.cfg.stall_timeout_s, f"trainer member {self.members.index}"
            )
        self.warm_up()
        if self.source is None and not self.stop_event.is_set():
            self._subscribe()
        try:
            while True:
                self._beat(f"agreeing on step {step + 1}")
                if self.consumer_failed is not None and not self.stop_event.is_set():
                    self._renew_consumer()
                t0 = time.perf_counter()
                # block on Kafka only when there is no batch to train
                starving = len(self.ready) < self.quota
                with span("consume", "kafka"):
                    msgs = self._read(starving)
                t1 = time.perf_counter()
                msgs = self.held.due() + msgs  # held records first: they were read first
                if msgs:
                    with span("intake", "kafka", records=len(msgs)):
                        for m in msgs:
                            self._intake(m)
                    self.held.settled()
                self._hold_back()
                self.timers["consume"] += t1 - t0
                self.timers["intake"] += time.perf_counter() - t1
                # a group may be complete but for a member held for the registry
                if self.source is None and not self.held:
                    self._expire_groups()
                for g in self.buffer.overflow():
                    self._drop_group(g, "buffer_full")
                if time.monotonic() - last_skip_check > 2.0:
                    self._skip_stale_ranges()
                    self._commit()  # a commit that failed, again
                    last_skip_check = time.monotonic()
                    if self.members.many and self.source is None:
                        self._assign_mine()  # partitions that appeared since
                action = self._next_action(step)
                if action == "stop":
                    break
                if action == "train":
                    step = self._train()
                elif action == "checkpoint":
                    self._checkpoint(announce=False)  # settle drops even when not training
            self._beat("stopping")
            if self.members.agree([self.ledger.dirty])[:, 0].any():
                self._checkpoint(announce=False)
        finally:
            if self.watchdog is not None:
                self.watchdog.close()
            budget = WaitBudget(self.cfg.stop_timeout_s)
            # the last version's sending and announcement (committed before it began)
            self.publisher.close(budget.left(self.cfg.stop_timeout_s / 2))
            self._finish_commits(budget.left(self.cfg.stop_timeout_s / 2))
            close_within(self.consumer, budget.left(), "trainer's consumer")
            if self.producer is not None:
                self.producer.flush(budget.left())
            self.ckpt.wait_until_finished()
        return step

    def _read(self, starving: bool) -> list[Any]:
        """The records that have arrived, up to 256; when ``starving`` and none has,
        waiting up to 0.2 s for the first. (``consume(n, timeout)`` returns once it holds
        ``n`` records or the timeout passed: asking for 256 at once waited the whole
        0.2 s whenever fewer had arrived, once a step, 16% of the trainer's time in the
        default run.)"""
        msgs = list(self.consumer.consume(256, 0))
        if not msgs and starving:
            msgs = list(self.consumer.consume(1, 0.2))
            if msgs:
                msgs += self.consumer.consume(255, 0)
        return msgs

    def _next_action(self, step: int) -> str:
        """What every member does next, agreed (one member alone decides by itself):
        ``stop``, ``train``, ``checkpoint`` (settle drops while not training) or ``wait``.

        A group trains when every member has its share of a batch ready; from Kafka also
        when the members hold a batch's groups between them, however unevenly (each
        contributes up to its share, the rest waits for the next step: no member's dry
        partitions stall the others), and, rather than wait forever, a partial batch
        once a member's batch timeout passed. From a recording, where each member's share
        is fixed, only full shares, and at its end what is left."""
        now = time.monotonic()
        stop = self.stop_event.is_set() or (
            self.cfg.max_steps is not None and step >= self.cfg.max_steps
        )
        exhausted = self.source is not None and self.source.exhausted and not self.held
        timed_out = (
            self.source is None
            and len(self.ready) > 0
            and now - self._last_step > self.cfg.batch_timeout_s
        )
        due = self.ledger.dirty and now - self._last_checkpoint > 10.0
        stops, ends, ready, late, dues = self.members.agree(
            [stop, exhausted, len(self.ready), timed_out, due]
        ).T
        if stops.any():
            return "stop"
        if (ready >= self.quota).all():
            return "train"
        if self.source is None and (ready.sum() >= self.cfg.groups_per_batch or late.any()):
            return "train"
        if ends.all():  # the recording's last, partial batch, then the end
            return "train" if ready.any() else "stop"
        return "checkpoint" if dues.any() else "wait"

    def _shapes(self) -> list[tuple[int, int]]:
        """The (rows, length) shapes of this member's batches: every length bucket of
        whole rows, or each packed row count at the largest bucket."""
        if not self.cfg.packing:
            return [(self.cfg.rows // self.members.count, t) for t in sorted(self.cfg.buckets)]
        return [(r, max(self.cfg.buckets)) for r in self.row_choices]

    def warm_up(self) -> None:
        """Compile the step for every batch shape now (ahead of time: nothing runs and
        the state is not touched), so that no step compiles once training runs."""
        for r, t in self._shapes():
            self._beat(f"compiling the step for {r} rows of {t} tokens")
            # a stop during start-up is not held up by compiles (a group stops together)
            if self.members.agree([self.stop_event.is_set()])[:, 0].any():
                return
            if self.cfg.packing:
                empty = pack([], r, t, self.cfg.grpo, version=self.version)[0]
            else:
                grpo = self.cfg.grpo
                empty = assemble([], r, self.cfg.buckets, grpo, length=t, version=self.version)[0]
            batch = self.members.batch(empty, self.batch_sharding)
            self.train_step.lower(self.state, batch).compile()

    def _intake(self, message: Any) -> None:
        """One consumed message (or a held or recorded :class:`Record`): settled by a
        verdict, held for the registry, or waiting in its group."""
        if isinstance(message, Record):
            m = message
        else:
            err = message.error()
            if err is not None:
                if err.code() != confluent_kafka.KafkaError._PARTITION_EOF:
                    log.warning("consumer error=%s", err.str())
                if fatal(err):
                    self.consumer_failed = err.str()
                return
            m = Record.of(message)  # read once: the client is not asked again
        tp = (m.topic, m.partition)
        where = Coordinates(m.topic, m.partition, m.offset, m.timestamp_ms)
        if self.tracker.is_settled(tp, m.offset):
            self.tracker.skip(tp, m.offset)
            return
        self.tracker.read(tp, m.offset)
        env = env_of(m.topic) or "?"
        if self.source is None and where.timestamp_ms > 0:  # time the record spent in Kafka
            metric("kafka_latency_s", time.time() - where.timestamp_ms / 1000, env=env)
        # (a recording has no bound on versions: it is trained from version 0 again)
        verdict = self.judge(m, self._stale, None if self.source is not None else self.version)
        if isinstance(verdict, RegistryUnavailableError):  # it may be valid: not settled
            return self.held.hold(m, verdict)
        if isinstance(verdict, RecordDecodeError):
            self.dead_letters.send(m, verdict)
            self._drop(None, where, verdict.reason, env)
            return self._release_group(m, None, verdict.reason)
        if isinstance(verdict, str):  # dropped without being invalid (stale, too long ...)
            return self._drop(None, where, verdict, env)
        t = verdict
        if self._all_stale([t]):
            return self._drop(t.trajectory_id, where, "stale", env)
        for reason, unfit in (
            ("too_long", bucket_for(t.num_tokens, self.cfg.buckets) is None),
            ("group_size", t.group_size != self.cfg.group_size),
        ):
            if unfit:
                self._drop(t.trajectory_id, where, reason, env)
                return self._release_group(m, t.group_id, reason)
        group = self.buffer.add(t, where)
        if isinstance(group, Refused):
            if group.invalid:
                self.dead_letters.send(m, RecordDecodeError(group.reason, group.detail))
            return self._drop(t.trajectory_id, where, group.reason, env)
        if group is not None:
            if group.late:
                self.late_members += 1
                metric("late_member", 1, env=group.env)
            self.ready.put(group)
        return None

    def _stale(self, min_version: int) -> bool:
        return self.version - min_version > self.cfg.max_staleness

    def _all_stale(self, ts: list[Trajectory]) -> bool:
        """Whether trajectories (a record, or a group's members) are too stale to train:
        the oldest token of any (``stale_tokens: drop``), or every token of all
        (``mask``). A trajectory without policy tokens has no staleness."""
        if self.mask_stale:
            newest = [t.max_version for t in ts if t.max_version >= 0]
            return bool(newest) and self._stale(max(newest))
        oldest = min((t.min_version for t in ts), default=-1)
        return oldest >= 0 and self._stale(oldest)

    def _drop(self, tid: str | None, w: Coordinates, reason: str, env: str) -> None:
        self.tracker.settle((w.topic, w.partition), w.offset)
        self.ledger.drop(tid, w.topic, w.partition, w.offset, reason)
        self.drops[reason] += 1
        self.drops_by_env[f"{env}:{reason}"] += 1
        metric("drop", 1, reason=reason, env=env)

    def _release_group(self, m: Record, gid: str | None, reason: str) -> None:
        """A member of a group was refused or dropped: the group (``gid``, or the
        record's key, which producers set to the group id) can never complete, so its
        waiting members are dropped now, not when ``group_timeout_s`` expires: the
        committed position, and with it the producers' budget, moves on at once."""
        if gid is None:
            try:
                gid = (m.key or b"").decode("utf-8")
            except UnicodeDecodeError:
                return
        if not gid or reason == "duplicate":  # a repeat: the group itself is sound
            return
        group = self.buffer.refuse_group(gid, reason)
        if group is not None:
            self._drop_group(group, "group_refused")

    def _expire_groups(self, now: float | None = None) -> None:
        """Incomplete groups past ``group_deadline_s`` with enough members go to training
        as they are; those past ``group_timeout_s`` are dropped."""
        if self.cfg.group_deadline_s:
            for g in self.buffer.due(self.cfg.group_deadline_s, self.cfg.min_group_members, now):
                self.partial_groups += 1
                metric("partial_group", 1, env=g.env, members=str(len(g.members)))
                self.ready.put(g)
        for g in self.buffer.expired(now):
            self._drop_group(g, "incomplete_group")

    def _drop_group(self, g: Any, reason: str) -> None:
        for mem in g.members.values():
            self._drop(mem.trajectory.trajectory_id, mem.where, reason, g.env)

    # ---- a step -------------------------------------------------------------------------

    def _fresh_groups(self) -> list[Any]:
        """Up to a batch of ready groups, dropping those that went stale while they
        waited (the version moved on since they passed the filter)."""
        groups: list[Any] = []
        while len(groups) < self.quota and len(self.ready):
            for g in self.ready.take(self.quota - len(groups)):
                if self._all_stale([m.trajectory for m in g.members.values()]):
                    self._drop_group(g, "stale")
                elif self.cfg.grpo.dynamic_sampling and zero_variance(
                    all_rewards(g, self.cfg.grpo)
                ):
                    self._drop_group(g, "zero_variance")  # DAPO: no signal in it
                else:
                    groups.append(g)
        return groups

    def _train(self) -> int:
        self._last_step = time.monotonic()
        t0 = time.perf_counter()
        with span("staleness_filter", "train"):
            groups = self._fresh_groups()
        # every member's groups and the shape its batch needs: one batch shape for all
        counts, needs = self.members.agree([len(groups), self._needs(groups)]).T
        if not counts.any():
            return int(self.state.step)
        with span("batch_assembly", "train", groups=len(groups)):
            batch, members = self._assemble(groups, int(needs.max()))
        t1 = time.perf_counter()
        self.timers["assemble"] += t1 - t0
        self._beat(f"training step {int(self.state.step) + 1}")
        with span("train_step", "train", step=int(self.state.step) + 1, trained=len(members)):
            self.state, metrics = self.train_step(
                self.state, self.members.batch(batch, self.batch_sharding)
            )
            got = jax.device_get(metrics)
            log_ratio = got.pop("sampler_log_ratio")
            m: dict[str, Any] = {k: float(v) for k, v in got.items()}
            if self.cfg.step_delay_s:
                time.sleep(self.cfg.step_delay_s)
        t2 = time.perf_counter()
        self.timers["step"] += t2 - t1
        if not m.pop("applied"):
            return self._not_applied(groups, m)
        self.nonfinite_in_a_row = 0
        first_row = self.members.index * batch.tokens.shape[0]
        m.update(
            check(log_ratio, members, first_row, self.cfg.parity_threshold, int(self.state.step))
        )
        # (a trajectory without policy tokens, e.g. an environment that timed out on
        # reset, has no version and no staleness)
        stale = [
            self.version - mem.trajectory.min_version
            for mem in members
            if mem.trajectory.min_version >= 0
        ]
        for mem in members:
            w = mem.where
            self.tracker.settle((w.topic, w.partition), w.offset)
            self.ledger.train(mem.trajectory.trajectory_id, w.topic, w.partition, w.offset)
        self.version += 1
        step = int(self.state.step)
        real = sum(mem.trajectory.num_tokens for mem in members)  # of this member's batch
        by_env: dict[str, list[Trajectory]] = {}
        for mem in members:
            by_env.setdefault(mem.trajectory.env, []).append(mem.trajectory)
        m.update(
            {
                "step": step,
                "version": self.version,
                "time": time.time(),
                "tokens": int(batch.mask.sum()),
                "bucket": int(batch.tokens.shape[1]),
                "rows": int(batch.tokens.shape[0]),
                "sequence_tokens": real,
                "padding": 1.0 - real / batch.tokens.size,
                "staleness_mean": float(np.mean(stale)) if stale else 0.0,
                "staleness_hist": dict(Counter(int(s) for s in stale)),
                "reward": {e: float(np.mean([t.reward for t in ts])) for e, ts in by_env.items()},
                "success": {
                    e: float(np.mean([t.succeeded for t in ts])) for e, ts in by_env.items()
                },
                # share of episodes that called a tool at least once
                "tool_call_rate": {e: tool_call_rate(ts) for e, ts in by_env.items()},
                # share of tool calls that came back as errors (0 where none was made)
                "tool_error_rate": {e: tool_error_rate(ts) for e, ts in by_env.items()},
                "drops": dict(self.drops),
                "partial_groups": self.partial_groups,
                "late_members": self.late_members,
                "lag": self._lag(),
            }
        )
        if step % self.cfg.publish_every == 0:
            self._checkpoint(announce=True, metrics=m)
        else:
            self.ledger.close_step(step, self.version)
        self.timers["checkpoint"] += time.perf_counter() - t2
        busy = sum(self.timers[k] for k in ("assemble", "step", "checkpoint"))
        m["busy_share"] = busy / max(1e-9, sum(self.timers.values()))
        m["busy_s"], m["idle_s"] = busy, sum(self.timers.values()) - busy  # since start
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(m) + "\n")
        self.trained += len(members)
        self.last_metrics = m
        self.scalars.write(
            step, flatten({k: v for k, v in m.items() if k != "staleness_hist"}, "train"), m["time"]
        )
        if self.on_step:
            self.on_step(m)
        return step

    def _needs(self, groups: list[Any]) -> int:
        """What this member's batch needs: the packed rows, or the length bucket of its
        longest trajectory (0 without groups)."""
        if self.cfg.packing:
            return rows_to_pack(groups, max(self.cfg.buckets))
        longest = max(
            (m.trajectory.num_tokens for g in groups for m in g.members.values()), default=0
        )
        return (bucket_for(longest, self.cfg.buckets) or 0) if groups else 0

    def _assemble(self, groups: list[Any], need: int) -> tuple[Any, list[Any]]:
        """This member's part of the step's batch, in the shape every member can use
        (``need``: the most any member needs)."""
        v = self.version
        # stale_tokens: mask: no gradient through the tokens of versions past the bound
        oldest = v - self.cfg.max_staleness if self.mask_stale else None
        if not self.cfg.packing:
            rows = self.cfg.rows // self.members.count
            return assemble(
                groups, rows, self.cfg.buckets, self.cfg.grpo, need, version=v, oldest=oldest
            )
        rows = next(r for r in self.row_choices if r >= need)
        length = max(self.cfg.buckets)
        first = self.members.index * rows
        return pack(groups, rows, length, self.cfg.grpo, first_row=first, version=v, oldest=oldest)

    def _not_applied(self, groups: list[Any], m: dict[str, Any]) -> int:
        """A step whose loss or gradients were not finite changed nothing: its records
        are settled as ``non_finite_step``; too many in a row stop the trainer."""
        for g in groups:
            self._drop_group(g, "non_finite_step")
        self.nonfinite_steps += 1
        self.nonfinite_in_a_row += 1
        log.warning(
            "step not applied: loss=%s grad_norm=%s groups=%d in_a_row=%d",
            m.get("loss"),
            m.get("grad_norm"),
            len(groups),
            self.nonfinite_in_a_row,
        )
        if self.nonfinite_in_a_row >= self.cfg.max_nonfinite_steps:
            self._checkpoint(announce=False)  # the drops are settled; the model is intact
            raise TrainingDivergedError(
                f"{self.nonfinite_in_a_row} training steps in a row had a non-finite loss or "
                f"gradient (loss {m.get('loss')}, gradient norm {m.get('grad_norm')}); none "
                f"was applied and version {self.version} is the last one published: lower "
                "the learning rate or look at the records of the last steps in the ledger "
                "(reason non_finite_step)"
            )
        return int(self.state.step)

    def samples(self) -> list[Sample]:
        """This trainer's figures for Prometheus (read at scrape time)."""
        return trainer_samples(self)

    def _checkpoint(self, announce: bool, metrics: dict[str, Any] | None = None) -> None:
        """Ledger line durable, then the checkpoint, then offsets committed, then (if
        ``announce``) the parameters saved for producers and announced."""
        step = int(self.state.step)
        self._beat(f"checkpointing step {step}")
        if not all_finite(self.state.trained):  # never saved, never announced
            raise TrainingDivergedError(
                f"the parameters at step {step} are not finite; nothing was saved or "
                f"announced after version {self.version - 1}"
            )
        seq = self.ledger.close_step(step, self.version)
        if announce:
            self.version_times[self.version] = int(time.time() * 1000)
        # every member's ledger line and positions, in one checkpoint the group saves
        # together (numbered by the furthest ledger, so numbers only grow)
        group = self.members.gather_json({"seq": seq, "positions": self._own_positions()})
        meta = {
            "seq": seq,
            "step": step,
            "version": self.version,
            "positions": group[0]["positions"],
            "members": group,
            "version_times": {
                str(k): v
                for k, v in self.version_times.items()
                if k >= self.version - self.cfg.max_staleness - 1
            },
        }
        with span("checkpoint_save", "train", step=step, version=self.version):
            self.ckpt.save(
                max(int(g["seq"]) for g in group),
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(self.state), meta=ocp.args.JsonSave(meta)
                ),
            )
            self.ckpt.wait_until_finished()  # durable before anything is committed
        self._last_checkpoint = time.monotonic()
        # The committed offset is where a restart resumes (the lowest unsettled record).
        # Its metadata is the trainer's progress for producers' admission control: how
        # far it has read, less the records it read that still wait for training, so
        # that ``high - progress`` counts every record not yet trained or dropped (the
        # committed offset alone would also count the settled records above it).
        owned = self._own_positions()
        offsets = [
            confluent_kafka.TopicPartition(
                t, p, self.tracker.low((t, p)), str(self._progress((t, p)))
            )
            for t, p in self.tracker.partitions()
            if f"{t}:{p}" in owned
        ]
        self._uncommitted = offsets
        self._commit()
        if announce:
            with span("announce", "train", step=step, version=self.version):
                self._announce(step, metrics or {})

    def _announce(self, step: int, m: dict[str, Any]) -> None:
        state = self.state
        adapters = None if state.adapters is None else (lambda: state.adapters)
        self.publisher.publish(
            self.version, step, lambda: nnx.merge(self.graphdef, state.params), m, adapters
        )
