"""The policy's settings: its sizes (and named presets), how tokens are drawn.

Kept apart from the model's code so that reading or printing a configuration needs no
accelerator runtime.
"""

from __future__ import annotations

import dataclasses
import json

from pipeline.errors import InvalidConfigError


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the policy. The default trains on two CPU cores in minutes."""

    #: token ids the model knows
    vocab_size: int = 272
    #: width of the residual stream
    d_model: int = 128
    #: transformer blocks
    num_layers: int = 2
    #: attention heads (d_model must be a multiple)
    num_heads: int = 4
    #: width of the feed-forward layer
    d_ff: int = 512
    #: longest sequence (positions) the model reads
    max_len: int = 256

    def __post_init__(self) -> None:
        sizes = dataclasses.astuple(self)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
            raise InvalidConfigError(f"model sizes must be integers: {str(self)[:300]}")
        if min(sizes) < 1 or max(sizes) > 2**24:
            raise InvalidConfigError(f"model sizes must lie in [1, 2**24]: {str(self)[:300]}")
        if self.d_model % self.num_heads:
            raise InvalidConfigError(
                f"d_model {self.d_model} is not a multiple of num_heads {self.num_heads}"
            )

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        """A preset by name (``tiny``, ``small``, ``base``)."""
        if name not in PRESETS:
            raise InvalidConfigError(
                f"unknown model {name!r}: give one of {', '.join(PRESETS)} or its sizes"
            )
        return PRESETS[name]

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

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
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise InvalidConfigError(
                f"temperature must be >= 0 and top_p in (0, 1], got {self.temperature}, "
                f"{self.top_p}"
            )
