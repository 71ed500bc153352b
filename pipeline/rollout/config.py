"""The producer's settings: what a producer process runs, the bounds of an episode, when
new groups may start."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from connectors.base import with_latency
from pipeline.errors import InvalidConfigError, check_range
from pipeline.policy.config import (
    ModelConfig,
    SamplingConfig,
    check_swap_kv,
    check_weights_source,
)
from pipeline.records.trajectory import MAX_ABS_REWARD


@dataclass(frozen=True)
class EpisodeLimits:
    """Bounds of one episode: tokens per policy turn, policy turns, seconds, tokens of
    one observation (prompt, tool result or environment answer; longer ones are cut),
    and the magnitude of the episode's reward (an environment past it is an
    ``env_error``: no record may carry a reward the trainer refuses)."""

    #: tokens per policy turn
    max_new_tokens: int = 4
    #: policy turns per episode
    max_policy_turns: int = 8
    #: seconds one environment call may take
    step_timeout_s: float = 10.0
    #: seconds one episode may take
    episode_timeout_s: float = 120.0
    #: tokens of one observation (longer ones are cut)
    max_observation_tokens: int = 1024
    #: largest reward magnitude an environment may give (past it: env_error)
    max_abs_reward: float = MAX_ABS_REWARD

    def __post_init__(self) -> None:
        for name, value, low, above in (
            ("max_new_tokens", self.max_new_tokens, 1, False),
            ("max_policy_turns", self.max_policy_turns, 1, False),
            ("step_timeout_s", self.step_timeout_s, 0, True),
            ("episode_timeout_s", self.episode_timeout_s, 0, True),
            ("max_observation_tokens", self.max_observation_tokens, 1, False),
            ("max_abs_reward", self.max_abs_reward, 0, True),
        ):
            check_range(f"limits.{name}", value, low, above=above)


@dataclass(frozen=True)
class AdmissionConfig:
    """Hold back new episodes while the records not yet read by the trainer group
    ``<ns>.trainer`` plus the episodes in flight at every live producer exceed
    ``max_staleness`` steps of ``trainer_batch`` trajectories: more would be too stale when
    trained (see :mod:`pipeline.rollout.admission`)."""

    #: the staleness bound, in policy versions, the trainer's max_staleness (the same
    #: value): this producer pauses so that its trajectories arrive within it, the
    #: trainer drops those beyond it (-1: never pause)
    max_staleness: int = 2
    #: trajectories per trainer step, to turn the trainer's lag into steps
    trainer_batch: int = 64
    #: seconds between two reads of the trainer group's lag (and two heartbeats)
    poll_s: float = 0.25
    #: a peer producer silent this long is no longer counted (it died)
    heartbeat_timeout_s: float = 5.0
    #: end an episode in flight as soon as it is certain to arrive too stale (its first
    #: token more than ``max_staleness`` versions older than weights this producer has
    #: loaded: the trainer, ahead of those, would drop it), freeing its slot, and start
    #: no more members of its group; off: it finishes and the trainer drops it
    abort_stale: bool = False

    def __post_init__(self) -> None:
        check_range("admission.max_staleness", self.max_staleness, -1)
        check_range("admission.trainer_batch", self.trainer_batch, 1)
        check_range("admission.poll_s", self.poll_s, 0, above=True)
        check_range("admission.heartbeat_timeout_s", self.heartbeat_timeout_s, 0, above=True)


@dataclass(frozen=True)
class ProducerConfig:
    """What a producer process runs (``rlstream produce``; ``rlstream config show
    produce`` prints it resolved)."""

    #: short flags for settings of a section, and flags that set several at once
    FLAGS: ClassVar[dict[str, str | tuple[str, ...]]] = {
        "env_option": "env_options",
        "max_new_tokens": "limits.max_new_tokens",
        "temperature": "sampling.temperature",
        "top_p": "sampling.top_p",
        "stop": "stop_sequences",
        "checkpoint_root": "checkpoint_roots",
        "max_staleness": "admission.max_staleness",
        "trainer_batch": "admission.trainer_batch",
        "seed": ("seed", "sampling.seed"),
    }
    #: settings read from environment variables (a flag wins over them)
    ENV: ClassVar[dict[str, str]] = {
        "namespace": "RLSTREAM_NAMESPACE",
        "checkpoint_roots": "RLSTREAM_CHECKPOINT_ROOT",
    }

    #: experiment namespace: topics <ns>.rollouts.<env>, <ns>.weights, ...
    namespace: str = "rlstream"
    #: registered environment name (rlstream env list)
    env: str = "guess"
    #: environment constructor options (a VALUE is read as JSON if it parses)
    env_options: Mapping[str, Any] = field(default_factory=dict)
    #: MCP servers whose tools every episode gets besides the environment's own:
    #: mcp:COMMAND (a child process over stdio) or mcp:URL (streamable HTTP); repeatable
    tools: tuple[str, ...] = ()
    #: simulated environment latency, median in milliseconds (log-normal; 0: none)
    latency_ms: float = 0.0
    #: its log-normal shape
    latency_sigma: float = 1.0
    #: episodes in flight
    concurrency: int = 128
    #: GRPO group size: episodes per task
    group_size: int = 8
    #: partitions of the rollout topic if it does not exist yet
    partitions: int = 4
    #: this producer's name in records, status and metrics (default: a new one)
    producer_id: str = field(default_factory=lambda: f"producer-{uuid.uuid4().hex[:6]}")
    #: seed of the task draw
    seed: int = 0
    #: seed of the initial parameters; the trainer's ``seed``, so that version 0 is the
    #: same policy on both sides
    model_seed: int = 0
    #: synchronous mode: start at most this many episodes per policy version, then wait
    #: for the next version (the classic generate-then-train loop); None: asynchronous
    sync_batch: int | None = None
    #: stop after this many episodes (None: run until stopped)
    max_episodes: int | None = None
    #: stop (exit status non-zero) once this many episodes in a row failed; 0: never
    max_consecutive_failures: int = 200
    #: on SIGINT/SIGTERM, seconds in-flight episodes get to finish
    grace_s: float = 5.0
    #: then, how long the records of finished episodes may wait to be acknowledged (s);
    #: those still waiting are reported lost and the producer exits non-zero (a producer
    #: that ends by its episode count waits the whole delivery timeout instead)
    stop_timeout_s: float = 20.0
    #: texts that end a policy turn, besides <eos> and </call>
    stop_sequences: tuple[str, ...] = ()
    #: load the weights trainers announce when they lie under one of these folders (the
    #: default: runs/ under the current directory, where rlstream train and rlstream run
    #: write); the single value none: never load announced weights
    checkpoint_roots: tuple[Path, ...] = (Path("runs"),)
    #: where announced weights are read: auto (the announced folder when it lies under a
    #: checkpoint root and is readable here, else the copy the trainer sent to the
    #: cluster), directory or cluster
    weights_source: str = "auto"
    #: append one JSON status line per second here (None: no status file)
    status_file: Path | None = None
    #: serve Prometheus metrics on this port (0: any free port; None: off)
    metrics_port: int | None = None
    #: address the metrics port binds (0.0.0.0 for a Prometheus on another host)
    metrics_host: str = "127.0.0.1"
    #: bounds of one episode
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    #: how tokens are drawn
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    #: at a weights swap, keep the key-value rows of conversations in flight or recompute
    #: them with the new weights (keep | recompute)
    swap_kv: str = "keep"
    #: the policy: a preset's name (tiny, small, base), a Hugging Face checkpoint directory
    #: (Llama, Qwen2, Qwen3: rlstream model init makes one) or the sizes
    model: ModelConfig = field(default_factory=ModelConfig)
    #: who samples the policy's turns: local (this process's engine) or openai:URL (an
    #: inference server's OpenAI-compatible completions endpoint, token ids in and out)
    policy: str = "local"
    #: with openai:URL, the folder of a llama.cpp router (llama-server --models-dir) that
    #: each loaded version is written to as GGUF and loaded from (None: the server's model
    #: stays version 0, announced weights are not loaded)
    policy_models_dir: Path | None = None
    #: with openai:URL, seconds one turn may take at the server
    policy_timeout_s: float = 300.0
    #: with openai:URL, seconds turns wait for a server that does not answer before their
    #: episodes end
    policy_wait_s: float = 60.0
    #: when new groups may start
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.group_size < 1:
            raise InvalidConfigError("concurrency and group size must be at least 1")
        if self.sync_batch is not None and (
            self.sync_batch < self.group_size or self.sync_batch % self.group_size
        ):
            raise InvalidConfigError(
                f"sync batch {self.sync_batch} must be a positive multiple of the group "
                f"size {self.group_size}"
            )
        for name, value, low in (
            ("latency_ms", self.latency_ms, 0),
            ("latency_sigma", self.latency_sigma, 0),
            ("grace_s", self.grace_s, 0),
            ("stop_timeout_s", self.stop_timeout_s, 0),
            ("partitions", self.partitions, 1),
            ("max_consecutive_failures", self.max_consecutive_failures, 0),
            ("policy_timeout_s", self.policy_timeout_s, 0),
            ("policy_wait_s", self.policy_wait_s, 0),
        ):
            check_range(name, value, low)
        check_tools(self.tools)
        check_swap_kv(self.swap_kv)
        check_weights_source(self.weights_source)
        if any(str(r) == "none" for r in self.checkpoint_roots):
            if len(self.checkpoint_roots) > 1:
                raise InvalidConfigError(
                    "checkpoint root none (never load announced weights) cannot be given "
                    "with other roots"
                )
            object.__setattr__(self, "checkpoint_roots", ())
        self._check_policy()

    def _check_policy(self) -> None:
        from pipeline.policy.remote import server_url

        if server_url(self.policy) is None:
            if self.policy_models_dir is not None:
                raise InvalidConfigError("policy_models_dir is for --policy openai:URL")
            return
        if self.policy_models_dir is None and self.checkpoint_roots:
            raise InvalidConfigError(
                f"--policy {self.policy} cannot take announced weights without "
                "--policy-models-dir (the models folder of llama.cpp's router, llama-server "
                "--models-dir DIR); give --checkpoint-root none to sample the server's model "
                "as it is"
            )
        if self.policy_models_dir is not None and not self.policy_models_dir.is_dir():
            raise InvalidConfigError(
                f"policy models folder {self.policy_models_dir} is not a folder"
            )

    @property
    def env_kwargs(self) -> dict[str, Any]:
        """What the environment is built with: its options, the simulated latency and
        the MCP servers of its tools."""
        kw = with_latency(self.env_options, self.latency_ms, self.latency_sigma)
        return {**kw, "tools": self.tools} if self.tools else kw


@dataclass(frozen=True)
class EvalConfig:
    """What ``rlstream eval`` measures: the success of a policy on held-out episodes."""

    #: short flags for settings of a section
    FLAGS: ClassVar[dict[str, str | tuple[str, ...]]] = {"env_option": "env_options"}

    #: registered environment name (rlstream env list)
    env: str = ProducerConfig.env
    #: environment constructor options (a VALUE is read as JSON if it parses)
    env_options: Mapping[str, Any] = field(default_factory=dict)
    #: MCP servers whose tools every episode gets besides the environment's own:
    #: mcp:COMMAND (a child process over stdio) or mcp:URL (streamable HTTP); repeatable
    tools: tuple[str, ...] = ()
    #: a weights/v<N> folder (None: the initial parameters of model_seed)
    weights: Path | None = None
    #: the policy: a preset's name (tiny, small, base), a Hugging Face checkpoint directory
    #: (Llama, Qwen2, Qwen3: rlstream model init makes one) or the sizes
    model: ModelConfig = field(default_factory=ModelConfig)
    #: seed of the initial parameters
    model_seed: int = ProducerConfig.model_seed
    #: held-out episodes
    episodes: int = 200
    #: tokens per policy turn
    max_new_tokens: int = EpisodeLimits.max_new_tokens
    #: sampling temperature
    temperature: float = SamplingConfig.temperature
    #: seed of the held-out tasks
    seed: int = 0

    def __post_init__(self) -> None:
        check_tools(self.tools)


def check_tools(specs: tuple[str, ...]) -> None:
    """Every ``--tools`` value names an MCP server (mcp:COMMAND or mcp:URL)."""
    from connectors.mcp import check_spec

    for spec in specs:
        check_spec(spec)
