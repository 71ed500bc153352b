"""A Hugging Face checkpoint directory's ``config.json``, read into the fields of a
:class:`pipeline.policy.config.ModelConfig` (which checks them).

Both styles in circulation are read: the older top-level ``rope_theta`` with a
``rope_scaling`` object, and the ``rope_parameters`` object that transformers 5 writes.
Whatever rlstream does not implement (another model type, another rope scaling, a sliding
window, biases the family does not have) is refused in one sentence naming it, before any
weight is read. :mod:`pipeline.policy.hf_config` writes the reverse, for
``rlstream model export``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipeline.errors import InvalidConfigError

#: ``model_type`` → (family, the architecture class transformers builds for it)
MODEL_TYPES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

#: the longest context rlstream gives a loaded model unless told otherwise (its key-value
#: cache is allocated at this length)
DEFAULT_MAX_LEN = 2048

_MAX_CONFIG_BYTES = 1 << 20


def load_json(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; InvalidConfigError (one sentence) for anything else."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise InvalidConfigError(f"{what} {path} cannot be read: {e.strerror}") from None
    if size > _MAX_CONFIG_BYTES:
        raise InvalidConfigError(f"{what} {path} is {size} bytes, more than a configuration")
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:
        raise InvalidConfigError(f"{what} {path} is not JSON: {str(e)[:200]}") from None
    if not isinstance(value, dict):
        raise InvalidConfigError(f"{what} {path} holds {type(value).__name__}, not an object")
    return value


def read_model_fields(directory: Path, max_len: int = DEFAULT_MAX_LEN) -> dict[str, Any]:
    """The model configuration fields of the Hugging Face checkpoint in ``directory``."""
    if not directory.is_dir():
        raise InvalidConfigError(f"model directory {directory} does not exist")
    if not (directory / "config.json").is_file():
        raise InvalidConfigError(f"{directory} has no config.json: not a Hugging Face model")
    raw = load_json(directory / "config.json", "model configuration")
    fields = model_fields(raw, str(directory.resolve()), max_len)
    held = _layers_in_weights(directory)
    if held is not None and fields["num_layers"] > held:
        raise InvalidConfigError(
            f"config.json's num_hidden_layers {fields['num_layers']} is more than the "
            f"{held} layers its weights hold"
        )
    fields["output_vocab"] = tokenizer_vocab_size(directory) or 0
    return fields


#: the largest tokenizer.json rlstream reads (real ones are a few MB)
MAX_TOKENIZER_BYTES = 64 << 20


def load_tokenizer(path: Path) -> Any:
    """The ``tokenizers.Tokenizer`` in the file ``path`` (InvalidConfigError for one that
    is too large or is no tokenizer), read once per content: the configuration and the
    chat tokenizer of a process both ask for it."""
    try:
        stat = path.stat()
    except OSError as e:
        raise InvalidConfigError(f"{path} cannot be read: {e.strerror}") from None
    if stat.st_size > MAX_TOKENIZER_BYTES:
        raise InvalidConfigError(
            f"{path} is {stat.st_size} bytes, more than the {MAX_TOKENIZER_BYTES >> 20} MB a "
            "tokenizer may take"
        )
    return _load_tokenizer(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str, size: int, mtime_ns: int) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the library raises its own exception types
        raise InvalidConfigError(f"{path} is not a tokenizer: {str(e)[:200]}") from None


def tokenizer_vocab_size(directory: Path) -> int | None:
    """The ids ``tokenizer.json`` of ``directory`` can emit (added tokens included), or
    None when it has none (loading the tokenizer then says why)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    return int(load_tokenizer(path).get_vocab_size(with_added_tokens=True))


def _layers_in_weights(directory: Path) -> int | None:
    """How many transformer layers the weights' tensor names hold (from the shard
    index or the single file's header, no tensor read), or None when they cannot be
    read here (loading the weights then says why)."""
    from pipeline.policy import tensorfile

    index = directory / "model.safetensors.index.json"
    names: Iterable[str]
    try:
        if index.is_file():
            weight_map = load_json(index, "shard index").get("weight_map")
            if not isinstance(weight_map, dict):
                return None
            names = weight_map
        elif (directory / "model.safetensors").is_file():
            names = tensorfile.read_header(directory / "model.safetensors").tensors
        else:
            return None
    except InvalidConfigError:
        return None
    layers = {m.group(1) for n in names if (m := _LAYER.match(str(n)))}
    return len(layers)


_LAYER = re.compile(r"model\.layers\.(\d{1,9})\.")


_REQUIRED = object()


def _get(raw: dict[str, Any], key: str, kind: type, default: Any = _REQUIRED) -> Any:
    """``raw[key]`` checked to be a ``kind`` (an int is a float too), or ``default``."""
    value = raw.get(key)
    if value is None:
        if default is _REQUIRED:
            raise InvalidConfigError(f"config.json lacks {key!r}")
        return default
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and not isinstance(value, bool)
    if not ok:
        raise InvalidConfigError(f"config.json: {key!r} is {value!r}, not a {kind.__name__}")
    return value


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta`` and the llama3 scaling fields, from either config style."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise InvalidConfigError(f"config.json: rope_parameters is {params!r}, not an object")
    if scaling is not None and not isinstance(scaling, dict):
        raise InvalidConfigError(f"config.json: rope_scaling is {scaling!r}, not an object")
    spec: dict[str, Any] = {**(scaling or {}), **(params or {})}
    theta = spec.get("rope_theta", raw.get("rope_theta"))
    kind = spec.get("rope_type", spec.get("type", "default"))
    out: dict[str, Any] = {
        "rope_theta": float(_get({"rope_theta": theta}, "rope_theta", float, 10000.0))
    }
    if kind in (None, "default"):
        return out
    if kind != "llama3":
        raise InvalidConfigError(
            f"rope scaling {kind!r} is not supported (rlstream implements none and llama3)"
        )
    out["rope_scaling"] = "llama3"
    out["rope_factor"] = float(_get(spec, "factor", float))
    out["rope_low_freq_factor"] = float(_get(spec, "low_freq_factor", float))
    out["rope_high_freq_factor"] = float(_get(spec, "high_freq_factor", float))
    out["rope_original_max_len"] = _get(spec, "original_max_position_embeddings", int)
    return out


def model_fields(
    raw: dict[str, Any], path: str = "", max_len: int = DEFAULT_MAX_LEN
) -> dict[str, Any]:
    """Model configuration fields from those of a Hugging Face ``config.json``."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise InvalidConfigError(
            f"model type {model_type!r} is not supported (rlstream implements "
            f"{', '.join(MODEL_TYPES)})"
        )
    family = MODEL_TYPES[model_type][0]
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise InvalidConfigError(f"activation {act!r} is not supported ({family} uses silu)")
    if raw.get("use_sliding_window"):
        raise InvalidConfigError("sliding-window attention is not supported")
    if family == "llama" and raw.get("mlp_bias"):
        raise InvalidConfigError("llama with mlp_bias is not supported")
    if family in ("llama", "qwen3") and raw.get("attention_bias"):
        raise InvalidConfigError(f"{family} with attention_bias is not supported")
    heads = _get(raw, "num_attention_heads", int)
    hidden = _get(raw, "hidden_size", int)
    positions = _get(raw, "max_position_embeddings", int, 2048)
    head_dim = raw.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool)):
        raise InvalidConfigError(f"config.json: 'head_dim' is {head_dim!r}, not an int")
    return dict(
        family=family,
        vocab_size=_get(raw, "vocab_size", int),
        d_model=hidden,
        num_layers=_get(raw, "num_hidden_layers", int),
        num_heads=heads,
        num_kv_heads=_get(raw, "num_key_value_heads", int, heads),
        head_size=head_dim or 0,
        d_ff=_get(raw, "intermediate_size", int),
        max_len=min(positions, max_len),
        norm_eps=float(_get(raw, "rms_norm_eps", float, 1e-6)),
        tie_embeddings=_get(raw, "tie_word_embeddings", bool, False),
        path=path,
        **_rope(raw),
    )
