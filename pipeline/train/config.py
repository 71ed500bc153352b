"""The trainer's settings: what a trainer process does, its loss and optimiser."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from pipeline.errors import InvalidConfigError, check_choice, check_range
from pipeline.kafka.client import MAX_MESSAGE_BYTES
from pipeline.kafka.topics import check_name
from pipeline.policy.config import LoRAConfig, ModelConfig
from pipeline.records.trajectory import MAX_ABS_REWARD

#: what the trainer does with a trajectory whose oldest tokens are past the staleness
#: bound (``TrainerConfig.stale_tokens``)
STALE_TOKENS = ("drop", "mask")
#: what the trainer does with a member that arrives after its group was trained at its
#: deadline (``TrainerConfig.late_members``)
LATE_MEMBERS = ("drop", "train")
#: how a step's token losses are averaged (``GRPOConfig.aggregation``)
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Loss and optimiser settings."""

    #: AdamW's peak learning rate (after warm-up)
    learning_rate: float = 1e-3
    #: steps of linear warm-up from 0
    warmup_steps: int = 5
    #: after the warm-up, steps of cosine decay to decay_floor times the peak (0: the
    #: learning rate stays at its peak)
    decay_steps: int = 0
    #: where the cosine decay ends, as a fraction of the peak learning rate
    decay_floor: float = 0.1
    #: AdamW's weight decay
    weight_decay: float = 0.0
    #: gradients are clipped to this global norm
    max_grad_norm: float = 1.0
    #: PPO clip range below 1 (ratio >= 1 - clip_low)
    clip_low: float = 0.2
    #: PPO clip range above 1 (ratio <= 1 + clip_high; DAPO's clip-higher)
    clip_high: float = 0.28
    #: truncation of the behaviour importance weight
    is_cap: float = 2.0
    #: off-policy correction: tis (truncated importance sampling: the clipped ratio
    #: against the behaviour policy), decoupled (PPO against the proximal policy) or none
    #: (stale samples taken as on-policy); tis learned more in every seed of the sweep
    #: in docs/benchmarks.md
    correction: str = "tis"
    #: loss aggregation: token_mean, seq_mean_token_mean or seq_mean_token_sum;
    #: seq_mean_token_mean (the default since the sweep in docs/benchmarks.md) had the
    #: higher minimum and median gain over five seeds
    aggregation: str = "seq_mean_token_mean"
    #: coefficient of the KL penalty to the initial policy (0: none)
    kl_coef: float = 0.0
    #: estimator of that KL per token: k1 (log-ratio) or k3 (never negative)
    kl_estimator: str = "k3"
    #: optimiser updates per batch (the batch split into this many minibatches)
    minibatches: int = 1
    #: slices of a minibatch whose gradients are accumulated into its one update (the
    #: same update as the whole minibatch at once, in a fraction of the memory)
    microbatches: int = 1
    #: advantages: grpo (group mean and std), drgrpo (group mean only), rloo
    #: (leave-one-out mean) or gae (PPO: a value head on the policy and generalised
    #: advantage estimation)
    advantage: str = "grpo"
    #: gae: the steps credit is assigned over, token (every policy token) or turn (every
    #: policy turn of a multi-turn episode, its tokens sharing the turn's advantage)
    credit: str = "token"
    #: gae: discount per step
    gamma: float = 1.0
    #: gae: lambda, between one-step (0) and Monte Carlo (1) estimates
    gae_lambda: float = 0.95
    #: gae: weight of the critic's squared error in the loss
    value_coef: float = 0.5
    #: importance ratio: token (PPO) or sequence (GSPO: each row's length-normalised ratio)
    ratio: str = "token"
    #: added to the group's reward std before dividing
    adv_eps: float = 1e-6
    #: DAPO dynamic sampling: drop groups whose rewards are all equal (no signal), as
    #: zero_variance in the ledger
    dynamic_sampling: bool = False
    #: DAPO overlong shaping: policy tokens allowed before the penalty is complete (0: off)
    overlong_max_tokens: int = 0
    #: the penalty grows linearly over this many tokens before overlong_max_tokens
    overlong_buffer: int = 0
    #: the penalty at and past overlong_max_tokens (subtracted from the reward)
    overlong_penalty: float = 1.0
    #: the sampling temperature of the trajectories trained (the producers'; 0, greedy,
    #: records log-probabilities at 1): log-probabilities and ratios are computed under
    #: the same temperature-scaled policy the behaviour log-probabilities were recorded
    #: under (rlstream run sets it from its temperature)
    temperature: float = 1.0

    def __post_init__(self) -> None:
        for field, number, low, above in (
            ("learning_rate", self.learning_rate, 0.0, True),
            ("warmup_steps", self.warmup_steps, 0.0, False),
            ("decay_steps", self.decay_steps, 0.0, False),
            ("weight_decay", self.weight_decay, 0.0, False),
            ("max_grad_norm", self.max_grad_norm, 0.0, True),
            ("clip_high", self.clip_high, 0.0, False),
            ("kl_coef", self.kl_coef, 0.0, False),
            ("adv_eps", self.adv_eps, 0.0, True),
            ("overlong_max_tokens", self.overlong_max_tokens, 0.0, False),
            ("overlong_penalty", self.overlong_penalty, 0.0, False),
            ("temperature", self.temperature, 0.0, True),
        ):
            check_range(f"grpo.{field}", number, low, above=above)
        check_range("grpo.clip_low", self.clip_low, 0.0, 1.0)
        check_range("grpo.decay_floor", self.decay_floor, 0.0, 1.0)
        check_range("grpo.is_cap", self.is_cap, 0.0, above=True)
        if self.minibatches < 1 or self.microbatches < 1 or self.is_cap <= 0:
            raise InvalidConfigError("minibatches and microbatches must be >= 1, is_cap > 0")
        for name, value, allowed in (
            ("correction", self.correction, ("decoupled", "tis", "none")),
            ("aggregation", self.aggregation, AGGREGATIONS),
            ("advantage", self.advantage, ("grpo", "drgrpo", "rloo", "gae")),
            ("credit", self.credit, ("token", "turn")),
            ("ratio", self.ratio, ("token", "sequence")),
            ("kl_estimator", self.kl_estimator, ("k1", "k3")),
        ):
            check_choice(f"grpo.{name}", value, allowed)
        if not (0 <= self.gamma <= 1 and 0 <= self.gae_lambda <= 1 and self.value_coef >= 0):
            raise InvalidConfigError("gamma and gae_lambda must lie in [0, 1], value_coef >= 0")
        if self.overlong_max_tokens and not 0 < self.overlong_buffer <= self.overlong_max_tokens:
            raise InvalidConfigError("overlong_buffer must lie in (0, overlong_max_tokens]")

    def optimizer(self) -> Any:
        """AdamW with linear warm-up, optionally cosine decay, and global-norm clipping (an
        optax transformation)."""
        return adamw(
            self.learning_rate,
            self.warmup_steps,
            self.decay_steps,
            self.decay_floor,
            self.weight_decay,
            self.max_grad_norm,
        )


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """What ``rlstream sft`` does (``rlstream config show sft`` prints it resolved)."""

    FLAGS: ClassVar[dict[str, str | tuple[str, ...]]] = {}
    ENV: ClassVar[dict[str, str]] = {}

    #: the conversations, one JSON object per line ({"messages": [...], "tools": [...]})
    data: Path = Path("sft.jsonl")
    #: where model/ (the fine-tuned checkpoint), metrics.jsonl and loss.png go
    out: Path = Path("runs/sft")
    #: passes over the data
    epochs: int = 3
    #: stop after this many steps (None: after the epochs)
    max_steps: int | None = None
    #: packed rows per step
    rows: int = 8
    #: tokens per packed row (0: the model's max_len); a longer conversation is refused
    length: int = 0
    #: AdamW's peak learning rate (after warm-up), then cosine decay over the run
    learning_rate: float = 1e-3
    #: steps of linear warm-up
    warmup_steps: int = 10
    #: the learning rate at the end, as a fraction of the peak
    decay_floor: float = 0.1
    #: AdamW's weight decay
    weight_decay: float = 0.0
    #: gradients are clipped to this global norm
    max_grad_norm: float = 1.0
    #: seed of the order of the data and of LoRA's adapters
    seed: int = 0
    #: the model: a Hugging Face checkpoint directory (rlstream model init makes one)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    #: low-rank adapters: with a rank only they are trained, then merged into model/
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        for name, value, low, above in (
            ("epochs", self.epochs, 1, False),
            ("max_steps", 1 if self.max_steps is None else self.max_steps, 1, False),
            ("rows", self.rows, 1, False),
            ("length", self.length, 0, False),
            ("learning_rate", self.learning_rate, 0, True),
            ("warmup_steps", self.warmup_steps, 0, False),
            ("weight_decay", self.weight_decay, 0, False),
            ("max_grad_norm", self.max_grad_norm, 0, True),
        ):
            check_range(name, value, low, above=above)
        check_range("decay_floor", self.decay_floor, 0.0, 1.0)
        if self.length and self.model.path and self.length > self.model.max_len:
            raise InvalidConfigError(
                f"length {self.length} exceeds the model's max_len {self.model.max_len}"
            )


def default_buckets(max_len: int) -> tuple[int, ...]:
    """64 doubled while it fits ``max_len`` (at least one bucket: ``max_len`` itself)."""
    out, b = [], 64
    while b <= max_len:
        out.append(b)
        b *= 2
    return tuple(out) or (max_len,)


def adamw(
    learning_rate: float,
    warmup_steps: int,
    decay_steps: int,
    decay_floor: float,
    weight_decay: float,
    max_grad_norm: float,
) -> Any:
    """AdamW with ``warmup_steps`` of linear warm-up, then (``decay_steps`` > 0) cosine
    decay to ``decay_floor`` times the peak, gradients clipped to ``max_grad_norm``."""
    import optax

    warmup = max(1, warmup_steps)
    schedule = optax.linear_schedule(0.0, learning_rate, warmup)
    if decay_steps:
        decay = optax.cosine_decay_schedule(learning_rate, decay_steps, alpha=decay_floor)
        schedule = optax.join_schedules([schedule, decay], [warmup])
    return optax.chain(
        optax.clip_by_global_norm(max_grad_norm),
        optax.adamw(schedule, weight_decay=weight_decay),
    )


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """What a trainer process does (``rlstream train``; ``rlstream config show train``
    prints it resolved)."""

    #: short flags for settings of a section
    FLAGS: ClassVar[dict[str, str | tuple[str, ...]]] = {
        "checkpoint_dir": "run_dir",
        "learning_rate": "grpo.learning_rate",
    }
    #: settings read from environment variables (a flag wins over them)
    ENV: ClassVar[dict[str, str]] = {
        "namespace": "RLSTREAM_NAMESPACE",
        "run_dir": "RLSTREAM_RUN_DIR",
    }

    #: experiment namespace: topics <ns>.rollouts.<env>, <ns>.weights, ...
    namespace: str = "rlstream"
    #: checkpoints, weights, ledger and metrics
    run_dir: Path = Path("runs/trainer")
    #: complete GRPO groups per step
    groups_per_batch: int = 8
    #: GRPO group size: trajectories per task
    group_size: int = 8
    #: the staleness bound, in policy versions, the producers' max_staleness (the same
    #: value): trajectories beyond it are dropped, producers pause to arrive within it
    max_staleness: int = 2
    #: drop a group still incomplete after this long (s)
    group_timeout_s: float = 120.0
    #: train a group this long (s) after its first member arrived with the members that
    #: have arrived, if at least min_group_members have (advantages over them); members
    #: that arrive later are handled as ``late_members`` says. 0: wait for the whole group
    group_deadline_s: float = 0.0
    #: the fewest members a group is trained with at its deadline
    min_group_members: int = 2
    #: a member arriving after its group was trained at its deadline: ``drop`` it (as
    #: ``late``), or ``train`` it in a later batch, its advantage computed over its group's
    #: members trained before it and itself
    late_members: str = "drop"
    #: a trajectory whose oldest tokens are past the staleness bound: ``drop`` it whole,
    #: or ``mask`` the tokens of versions past the bound (no gradient through them; the
    #: rest trains and its group stays whole), dropping it only when all of them are
    stale_tokens: str = "drop"
    #: train a partial batch (padding rows) when no full one came for this long (s)
    batch_timeout_s: float = 30.0
    #: padded sequence lengths (each must fit the model's max_len); a packed batch's rows
    #: are as long as the largest; empty: 64 doubled up to the model's max_len (64, 128,
    #: 256 for the built-in model; up to 1024 for a checkpoint of max_len 1024)
    buckets: tuple[int, ...] = ()
    #: several trajectories per row (each attending only to itself), in one of a few row
    #: counts; false: one trajectory per row, padded to its length bucket
    packing: bool = True
    #: sampling weight of each environment in a batch (default: equal)
    env_weights: Mapping[str, float] = dataclasses.field(default_factory=dict)
    #: save and announce weights every this many steps
    publish_every: int = 1
    #: also send each published version's files to the cluster (<ns>.weights-data), so
    #: that producers which cannot read the run directory (another machine) load them
    weights_to_cluster: bool = True
    #: checkpoints kept on disk
    keep_checkpoints: int = 3
    #: stop after this many steps (None: run until stopped)
    max_steps: int | None = None
    #: trajectories buffered while their groups complete
    max_buffered: int = 4096
    #: seed of the initial parameters and of batching
    seed: int = 0
    #: this trainer's name in metrics and telemetry (default: a new one)
    trainer_id: str = dataclasses.field(default_factory=lambda: f"trainer-{uuid.uuid4().hex[:6]}")
    #: sleep after each step (s), to test a slow trainer
    step_delay_s: float = 0.0
    #: how long a weights announcement may wait for the broker's acknowledgement before
    #: training goes on (the record stays queued and is delivered later)
    announce_timeout_s: float = 5.0
    #: at a stop, how long the last version's sending and announcement (half of it at
    #: most), the last offset commits and the consumer leaving its group may wait on the
    #: cluster, together (s): a cluster that is gone delays a stop this long once (what
    #: is not committed is in the checkpoint; what is not sent is in the run directory)
    stop_timeout_s: float = 20.0
    #: a record value larger than this goes to the dead-letter topic undecoded
    #: ("oversized"), so no single record can make the trainer hold more than this
    max_record_bytes: int = MAX_MESSAGE_BYTES
    #: rewards (and reward components) beyond this magnitude are refused (reward_bound)
    max_abs_reward: float = MAX_ABS_REWARD
    #: behaviour log-probabilities of policy tokens below this are refused (bad_logprob)
    min_logprob: float = -1e3
    #: this many consecutive steps with a non-finite loss or gradient stop the trainer
    max_nonfinite_steps: int = 5
    #: logprob parity: a trajectory with a token whose sampler and trainer
    #: log-probabilities (same policy version) differ by more than this is logged by id
    parity_threshold: float = 0.1
    #: this trainer's static group member id; a restart under the same id resumes at once
    instance: str = "0"
    #: serve Prometheus metrics on this port (0: any free port; None: off)
    metrics_port: int | None = None
    #: address the metrics port binds (0.0.0.0 for a Prometheus on another host)
    metrics_host: str = "127.0.0.1"
    #: devices of the trainer's mesh along its fsdp axis: batch rows and every weight
    #: matrix split over them (0: all the devices the tensor axis leaves)
    fsdp: int = 1
    #: devices along the tensor axis: attention heads, feed-forward width and vocabulary
    #: split over them
    tensor_parallel: int = 1
    #: trainer processes in this trainer group: one JAX job over all of their devices and
    #: one Kafka consumer group (each reads its own partitions)
    members: int = 1
    #: this process's index in the group, 0 to members - 1 (member 0 announces weights)
    member_index: int = 0
    #: host:port of the group's JAX coordinator, which member 0 serves
    coordinator: str = "127.0.0.1:7477"
    #: a member of a group whose loop has not come round for this long (s) exits (a
    #: member stopped answering, a collective never completed), so that the group is
    #: restarted instead of hanging; longer than the slowest step or checkpoint
    stall_timeout_s: float = 1800.0
    #: the policy: a preset's name (tiny, small, base), a Hugging Face checkpoint directory
    #: (Llama, Qwen2, Qwen3: rlstream model init makes one) or the sizes
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    #: the loss and the optimiser
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    #: low-rank adapters: with a rank, only they are trained and announced (producers
    #: apply them to the base they load once)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        check_name("namespace", self.namespace)
        for name, value, low, above in (
            ("groups_per_batch", self.groups_per_batch, 1, False),
            ("group_size", self.group_size, 1, False),
            ("max_staleness", self.max_staleness, 0, False),
            ("group_timeout_s", self.group_timeout_s, 0, True),
            ("batch_timeout_s", self.batch_timeout_s, 0, True),
            ("publish_every", self.publish_every, 1, False),
            ("keep_checkpoints", self.keep_checkpoints, 1, False),
            ("max_steps", 1 if self.max_steps is None else self.max_steps, 0, False),
            ("max_buffered", self.max_buffered, 1, False),
            ("step_delay_s", self.step_delay_s, 0, False),
            ("announce_timeout_s", self.announce_timeout_s, 0, True),
            ("stop_timeout_s", self.stop_timeout_s, 0, True),
            ("max_record_bytes", self.max_record_bytes, 1, False),
            ("max_abs_reward", self.max_abs_reward, 0, True),
            ("max_nonfinite_steps", self.max_nonfinite_steps, 1, False),
            ("parity_threshold", self.parity_threshold, 0, True),
            ("stall_timeout_s", self.stall_timeout_s, 10, False),  # not a restart loop
        ):
            check_range(name, value, low, above=above)
        check_range("min_logprob", self.min_logprob, high=0.0)
        check_choice("stale_tokens", self.stale_tokens, STALE_TOKENS)
        check_choice("late_members", self.late_members, LATE_MEMBERS)
        if self.group_deadline_s:
            check_range("group_deadline_s", self.group_deadline_s, 0, above=True)
            if self.group_deadline_s >= self.group_timeout_s:
                raise InvalidConfigError(
                    f"group_deadline_s {self.group_deadline_s:g} must be shorter than "
                    f"group_timeout_s {self.group_timeout_s:g}: the group would be dropped first"
                )
            check_range("min_group_members", self.min_group_members, 2, high=self.group_size)
        if self.buckets == ():
            object.__setattr__(self, "buckets", default_buckets(self.model.max_len))
        if not self.buckets or min(self.buckets) < 2:
            raise InvalidConfigError(f"buckets must be lengths of at least 2, got {self.buckets}")
        if max(self.buckets) > self.model.max_len:
            raise InvalidConfigError(
                f"bucket {max(self.buckets)} exceeds the model's max_len {self.model.max_len}"
            )
        if self.rows % (self.grpo.minibatches * self.grpo.microbatches):
            raise InvalidConfigError(
                f"{self.rows} batch rows do not divide evenly into {self.grpo.minibatches} "
                f"minibatches of {self.grpo.microbatches} micro-batches"
            )
        if self.fsdp < 0 or self.tensor_parallel < 1:
            raise InvalidConfigError(
                f"fsdp must be >= 0 and tensor_parallel >= 1, got {self.fsdp}, "
                f"{self.tensor_parallel}"
            )
        if self.members < 1 or not 0 <= self.member_index < self.members:
            raise InvalidConfigError(
                f"member_index must be in 0..members-1, got member_index={self.member_index} "
                f"members={self.members}"
            )
        if self.groups_per_batch % self.members:
            raise InvalidConfigError(
                f"{self.groups_per_batch} groups per batch do not split evenly over "
                f"{self.members} trainer members"
            )
        if self.members > 1 and (
            ":" not in self.coordinator or not self.coordinator.rsplit(":", 1)[1].isdigit()
        ):
            raise InvalidConfigError(f"coordinator must be host:port, got {self.coordinator!r}")
        if self.fsdp and (self.rows // self.grpo.minibatches) % self.fsdp:
            raise InvalidConfigError(
                f"a minibatch of {self.rows // self.grpo.minibatches} rows does not split "
                f"over fsdp={self.fsdp} devices"
            )

    @property
    def rows(self) -> int:
        return self.groups_per_batch * self.group_size
