"""The policy's settings: its sizes (and named presets), how tokens are drawn.

Kept apart from the model's code so that reading or printing a configuration needs no
accelerator runtime.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from pipeline.errors import InvalidConfigError, check_choice
from pipeline.policy.hf_format import read_model_fields

#: model families: the built-in policy and the Hugging Face families rlstream implements
FAMILIES = ("rlstream", "llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes and architecture of the policy. The default trains on two CPU cores in
    minutes; ``--model DIR`` reads all of this from a Hugging Face checkpoint directory
    (``config.json``), whose weights and tokenizer the policy then uses."""

    #: token ids the model knows
    vocab_size: int = 272
    #: width of the residual stream
    d_model: int = 128
    #: transformer blocks
    num_layers: int = 2
    #: attention heads
    num_heads: int = 4
    #: width of the feed-forward layer
    d_ff: int = 512
    #: longest sequence (positions) rlstream gives the model
    max_len: int = 256
    #: rlstream (built-in: GELU feed-forward), llama, qwen2 (q/k/v biases), qwen3 (q/k norms)
    family: str = "rlstream"
    #: key-value heads of grouped-query attention (0: as many as num_heads)
    num_kv_heads: int = 0
    #: width of one attention head (0: d_model / num_heads)
    head_size: int = 0
    #: the output layer shares the embedding's weights
    tie_embeddings: bool = True
    #: epsilon of the RMS norms
    norm_eps: float = 1e-6
    #: base of the rotary position embedding
    rope_theta: float = 10000.0
    #: rotary scaling: "" (none) or "llama3"
    rope_scaling: str = ""
    #: llama3 rope scaling: factor
    rope_factor: float = 8.0
    #: llama3 rope scaling: low-frequency factor
    rope_low_freq_factor: float = 1.0
    #: llama3 rope scaling: high-frequency factor
    rope_high_freq_factor: float = 4.0
    #: llama3 rope scaling: the context the model was first trained on
    rope_original_max_len: int = 8192
    #: parameters and activations: float32 or bfloat16 (log-probabilities are float32)
    dtype: str = "float32"
    #: Hugging Face checkpoint directory the weights and tokenizer come from ("": none)
    path: str = ""
    #: token ids the policy may produce: the tokenizer's vocabulary, when the output
    #: layer is padded beyond it (0: every id below vocab_size); read from the checkpoint
    output_vocab: int = 0

    _SIZES = ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_len")

    def __post_init__(self) -> None:
        sizes = [
            getattr(self, n)
            for n in (
                *self._SIZES,
                "num_kv_heads",
                "head_size",
                "output_vocab",
                "rope_original_max_len",
            )
        ]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
            raise InvalidConfigError(f"model sizes must be integers: {str(self)[:300]}")
        if min(sizes[:6]) < 1 or max(sizes) > 2**24 or min(sizes) < 0:
            raise InvalidConfigError(f"model sizes must lie in [1, 2**24]: {str(self)[:300]}")
        if self.output_vocab > self.vocab_size:
            raise InvalidConfigError(
                f"the tokenizer's vocabulary ({self.output_vocab} ids) is larger than the "
                f"model's vocab_size {self.vocab_size}: the tokenizer can emit ids the model "
                "has no embedding for"
            )
        if self.family not in FAMILIES:
            raise InvalidConfigError(
                f"model family {self.family!r} is not one of {', '.join(FAMILIES)}"
            )
        if self.dtype not in DTYPES:
            raise InvalidConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.rope_scaling not in ("", "llama3"):
            raise InvalidConfigError(
                f"rope scaling {self.rope_scaling!r} is not supported (none or llama3)"
            )
        if not self.head_size and self.d_model % self.num_heads:
            raise InvalidConfigError(
                f"d_model {self.d_model} is not a multiple of num_heads {self.num_heads}"
            )
        if self.num_heads % self.kv_heads:
            raise InvalidConfigError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}"
            )
        floats = (
            self.norm_eps,
            self.rope_theta,
            self.rope_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
        )
        if not all(isinstance(v, int | float) and 0 < v < 1e12 for v in floats):
            raise InvalidConfigError(
                "norm_eps, rope_theta and the rope factors (factor, low_freq_factor, "
                f"high_freq_factor) must be finite positive numbers: {floats}"
            )
        if self.rope_scaling == "llama3" and not (
            self.rope_high_freq_factor > self.rope_low_freq_factor
            and self.rope_original_max_len >= 1
        ):
            raise InvalidConfigError(
                "llama3 rope scaling needs high_freq_factor above low_freq_factor and a "
                f"positive original_max_position_embeddings, got {self.rope_low_freq_factor}, "
                f"{self.rope_high_freq_factor}, {self.rope_original_max_len}"
            )
        if self.head_dim % 2:
            raise InvalidConfigError(
                f"head_dim {self.head_dim} is odd: rotary position embeddings rotate pairs "
                "of dimensions"
            )

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        """A preset by name (``tiny``, ``small``, ``base``) or a Hugging Face checkpoint
        directory (its ``config.json``)."""
        if name in PRESETS:
            return PRESETS[name]
        if "/" in name or name.startswith(".") or Path(name).is_dir():
            return cls(**read_model_fields(Path(name)))
        raise InvalidConfigError(
            f"unknown model {name!r}: give one of {', '.join(PRESETS)}, a Hugging Face "
            "checkpoint directory or the model's sizes"
        )

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def gated(self) -> bool:
        """SwiGLU feed-forward (the Hugging Face families) rather than GELU (built-in)."""
        return self.family != "rlstream"

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    def same_architecture(self, other: ModelConfig) -> bool:
        """Whether parameters of one fit the other: everything but where the weights came
        from and the context length rlstream gives the model."""
        a = dataclasses.replace(self, path="", max_len=1)
        return a == dataclasses.replace(other, path="", max_len=1)

    def num_params(self) -> int:
        """Parameters of a model of this configuration."""
        d, hd, v = self.d_model, self.head_dim, self.vocab_size
        attn = d * hd * (self.num_heads * 2 + self.kv_heads * 2)
        if self.qkv_bias:
            attn += hd * (self.num_heads + 2 * self.kv_heads)
        if self.qk_norm:
            attn += 2 * hd
        mlp = d * self.d_ff * (3 if self.gated else 2)
        per_layer = attn + mlp + 2 * d
        return v * d * (1 if self.tie_embeddings else 2) + self.num_layers * per_layer + d

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        """The configuration in ``text``; InvalidConfigError for anything else."""
        try:
            fields = json.loads(text)
            return cls(**fields)
        except InvalidConfigError:
            raise
        except (ValueError, TypeError, RecursionError) as e:
            raise InvalidConfigError(f"not a model configuration: {str(e)[:200]}") from None


#: Configurations by name: ``tiny`` for CPUs and tests, larger ones for accelerators.
PRESETS = {
    "tiny": ModelConfig(),
    "small": ModelConfig(d_model=256, num_layers=4, num_heads=8, d_ff=1024, max_len=512),
    "base": ModelConfig(d_model=768, num_layers=12, num_heads=12, d_ff=3072, max_len=2048),
}


#: what a weights swap does to the key-value rows of conversations in flight: ``keep`` them
#: (computed with the older weights; the next tokens attend to them) or ``recompute`` them
#: with the new weights before the next step (that step prefills every conversation in
#: flight again)
SWAP_KV = ("keep", "recompute")


def check_swap_kv(value: object) -> None:
    check_choice("swap_kv", value, SWAP_KV)


#: where a producer reads the checkpoints trainers announce: the announced folder when it
#: is readable here and the copy sent to the cluster otherwise, only the folder, or only
#: the cluster's copy
WEIGHTS_SOURCES = ("auto", "directory", "cluster")


def check_weights_source(value: object) -> None:
    check_choice("weights_source", value, WEIGHTS_SOURCES)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn. ``temperature`` 0 is greedy."""

    #: softmax temperature (0: greedy)
    temperature: float = 1.0
    #: nucleus sampling: keep the smallest set of tokens with this much probability
    top_p: float = 1.0
    #: seed of the token draws
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf or not 0 < self.top_p <= 1:
            raise InvalidConfigError(
                "temperature must be a finite number >= 0 and top_p in (0, 1], got "
                f"{self.temperature}, {self.top_p}"
            )

    @property
    def logprob_temperature(self) -> float:
        return logprob_temperature(self.temperature)


def logprob_temperature(sampling_temperature: float) -> float:
    """The temperature recorded log-probabilities are taken at: the sampling temperature,
    or 1 when greedy (the sampler scores greedy tokens unscaled)."""
    return sampling_temperature if sampling_temperature > 0 else 1.0


#: the linear layers of a block low-rank adapters may be put on (gate only exists in the
#: gated, Hugging Face families)
LORA_TARGETS = ("q", "k", "v", "out", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters (LoRA): each target kernel ``W`` acts as ``W + alpha / rank * A
    @ B`` with ``A [in, rank]`` and ``B [rank, out]`` (``B`` zero at first). Only the
    adapters are trained and announced; the base stays as it was loaded."""

    #: rank of the adapters (0: no adapters, every parameter trained and announced)
    rank: int = 0
    #: the adapters' product is scaled by alpha / rank
    alpha: float = 16.0
    #: linear layers of every block that get adapters: q, k, v, out, gate, up, down
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        if (
            not isinstance(self.rank, int)
            or isinstance(self.rank, bool)
            or not (0 <= self.rank <= 4096)
        ):
            raise InvalidConfigError(f"lora rank must be an integer in [0, 4096], not {self.rank}")
        if not isinstance(self.alpha, int | float) or not 0 < self.alpha < 1e6:
            raise InvalidConfigError(f"lora alpha must be positive, not {self.alpha}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise InvalidConfigError(
                f"lora targets must be distinct names among {', '.join(LORA_TARGETS)}, "
                f"not {list(self.targets)}"
            )

    @property
    def scale(self) -> float:
        return self.alpha / max(self.rank, 1)

    def to_json(self) -> dict[str, object]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

    @classmethod
    def from_json(cls, fields: object) -> LoRAConfig:
        """The configuration in ``fields`` (a JSON object); InvalidConfigError otherwise."""
        if not isinstance(fields, dict) or set(fields) != {"rank", "alpha", "targets"}:
            raise InvalidConfigError(f"not a LoRA configuration: {str(fields)[:200]}")
        targets = fields["targets"]
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise InvalidConfigError(f"LoRA targets must be names: {str(targets)[:200]}")
        return cls(fields["rank"], fields["alpha"], tuple(targets))
