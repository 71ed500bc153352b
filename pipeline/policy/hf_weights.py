"""Parameters of a Hugging Face checkpoint directory, loaded into the policy and written
back.

Loading checks everything before a weight is read: the model fits in memory, the shard
index names existing files, every safetensors header is whole, and the tensors are
exactly the ones the configuration calls for (each missing, extra or misshapen one named).
Tensors are then memory-mapped, transposed into the policy's layout and cast to its dtype
one at a time, so nothing is half-loaded: either the whole model comes back or an
:class:`InvalidConfigError` says why not.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipeline.errors import InvalidConfigError
from pipeline.policy import tensorfile
from pipeline.policy.config import ModelConfig
from pipeline.policy.hf_config import hf_config
from pipeline.policy.hf_format import load_json
from pipeline.policy.model import Transformer

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

#: files of a checkpoint directory that are not weights and travel with an export
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)

_BLOCK = {
    "norm1": "input_layernorm",
    "norm2": "post_attention_layernorm",
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "out": "self_attn.o_proj",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
_LEAF = {"kernel": "weight", "bias": "bias", "scale": "weight", "embedding": "weight"}


def hf_name(path: tuple[Any, ...]) -> tuple[str, bool]:
    """The Hugging Face tensor name of the policy parameter at ``path`` and whether it is
    stored transposed (``Linear`` kernels are ``[in, out]`` here, ``[out, in]`` there)."""
    leaf = _LEAF[str(path[-1])]
    transposed = path[-1] == "kernel"
    if path[0] == "embed":
        return "model.embed_tokens.weight", False
    if path[0] == "norm":
        return "model.norm.weight", False
    if path[0] == "lm_head":
        return "lm_head.weight", True
    if path[0] == "blocks":
        return f"model.layers.{path[1]}.{_BLOCK[str(path[2])]}.{leaf}", transposed
    raise KeyError(path)


def _abstract(cfg: ModelConfig) -> tuple[nnx.GraphDef[Transformer], nnx.State]:
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[Any, ...], tuple[int, ...], bool]]:
    """``{hf name: (policy path, hf shape, transposed)}`` for a model of ``cfg``."""
    _, state = _abstract(cfg)
    out = {}
    for path, leaf in nnx.to_flat_state(state):
        name, transposed = hf_name(path)
        shape = tuple(leaf.get_value().shape)
        out[name] = (path, shape[::-1] if transposed else shape, transposed)
    return out


def estimate_bytes(cfg: ModelConfig, training: bool) -> int:
    """Memory a process needs for the model's parameters: serving holds them once,
    training also their gradients and Adam's two moments."""
    per = jnp.dtype(cfg.dtype).itemsize * cfg.num_params()
    return per * (4 if training else 1)


def available_bytes() -> int | None:
    """Memory this machine can still give (``MemAvailable``), or None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(cfg: ModelConfig, training: bool) -> None:
    """Refuse, before loading anything, a model whose parameters (with gradients and
    optimizer state when ``training``) will not fit in the memory left."""
    need, have = estimate_bytes(cfg, training), available_bytes()
    if have is not None and need > have:
        what = "train" if training else "serve"
        raise InvalidConfigError(
            f"the model needs about {need / 2**30:.1f} GiB to {what} "
            f"({cfg.num_params() / 1e6:.0f}M parameters in {cfg.dtype}) but "
            f"{have / 2**30:.1f} GiB is available"
        )


def _headers(directory: Path) -> dict[str, tensorfile.Header]:
    """``{tensor name: header of the file holding it}``, every file checked."""
    index = directory / INDEX
    if index.is_file():
        weight_map = load_json(index, "shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InvalidConfigError(f"{index.name} has no weight_map")
        files = sorted({str(f) for f in weight_map.values()})
        for f in files:
            if "/" in f or f.startswith(".") or not (directory / f).is_file():
                raise InvalidConfigError(f"{index.name} names shard {f!r}, which is not there")
        headers = {f: tensorfile.read_header(directory / f) for f in files}
        out = {}
        for name, f in weight_map.items():
            if name not in headers[str(f)].tensors:
                raise InvalidConfigError(f"{index.name} puts {name!r} in {f}, which lacks it")
            out[name] = headers[str(f)]
        return out
    single = directory / SINGLE
    if not single.is_file():
        raise InvalidConfigError(f"{directory} has neither {SINGLE} nor {INDEX}")
    header = tensorfile.read_header(single)
    return dict.fromkeys(header.tensors, header)


def _check_tensors(cfg: ModelConfig, headers: dict[str, tensorfile.Header]) -> None:
    want = expected_tensors(cfg)
    have = {n: h.tensors[n].shape for n, h in headers.items()}
    if cfg.tie_embeddings:
        have.pop("lm_head.weight", None)  # some tied checkpoints store the copy too
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    wrong = sorted(n for n in set(want) & set(have) if want[n][1] != have[n])
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    if extra:
        problems.append(f"unexpected {', '.join(extra[:5])}" + (" ..." if len(extra) > 5 else ""))
    for n in wrong[:5]:
        problems.append(
            f"{n} has shape {list(have[n])}, the configuration needs {list(want[n][1])}"
        )
    if problems:
        raise InvalidConfigError(f"the weights do not match config.json: {'; '.join(problems)}")


def check_checkpoint(cfg: ModelConfig) -> dict[str, tensorfile.Header]:
    """Every safetensors header of ``cfg.path``, checked whole and against ``cfg``."""
    if not cfg.path:
        raise InvalidConfigError("the model configuration names no checkpoint directory")
    headers = _headers(Path(cfg.path))
    _check_tensors(cfg, headers)
    return headers


def load_params(cfg: ModelConfig, training: bool = False) -> nnx.State:
    """The parameters in the checkpoint directory ``cfg.path``, as the policy's state."""
    check_fits(cfg, training)
    headers = check_checkpoint(cfg)
    directory = Path(cfg.path)
    dtype = jnp.dtype(cfg.dtype)
    _, state = _abstract(cfg)
    pure: dict[Any, Any] = {}
    for name, (path, _shape, transposed) in expected_tensors(cfg).items():
        array = tensorfile.tensor(headers[name], name)
        value = jnp.asarray(np.asarray(array.T if transposed else array).astype(dtype))
        if not bool(jnp.all(jnp.isfinite(value))):
            raise InvalidConfigError(f"tensor {name} of {directory} holds NaN or infinity")
        node = pure
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    nnx.replace_by_pure_dict(state, pure)
    return state


def load_model(cfg: ModelConfig, training: bool = False) -> Transformer:
    """A policy of ``cfg`` holding the weights of its checkpoint directory."""
    graphdef, _ = _abstract(cfg)
    return nnx.merge(graphdef, load_params(cfg, training))


def _hf_tensors(cfg: ModelConfig, params: Any) -> Iterator[tuple[str, np.ndarray]]:
    for path, leaf in nnx.to_flat_state(params):
        name, transposed = hf_name(path)
        array = np.asarray(
            jax.device_get(leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf)
        )
        yield name, np.ascontiguousarray(array.T if transposed else array)


def _config(cfg: ModelConfig, extra: dict[str, Any] | None) -> dict[str, Any]:
    """The ``config.json`` of a model of ``cfg``, with the special token ids of the
    checkpoint it came from."""
    config = hf_config(cfg, extra)
    source = Path(cfg.path) if cfg.path else None
    generation: dict[str, Any] = {}
    if source is not None:
        if (source / "config.json").is_file():
            original = load_json(source / "config.json", "model configuration")
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if key in original:
                    config[key] = original[key]
        if (source / "generation_config.json").is_file():
            generation = load_json(source / "generation_config.json", "generation configuration")
    for key in ("bos_token_id", "eos_token_id"):
        if key not in config and key in generation:
            config[key] = generation[key]
    return config


def hf_files(
    cfg: ModelConfig, params: Any
) -> tuple[dict[str, Any], dict[str, Any], Iterator[tuple[str, np.ndarray]]]:
    """What a Hugging Face directory of ``params`` would hold, in memory: its
    ``config.json``, its ``tokenizer.json`` and its tensors (one at a time)."""
    if not cfg.path or not (Path(cfg.path) / "tokenizer.json").is_file():
        raise InvalidConfigError(
            "the model has no tokenizer.json: a Hugging Face checkpoint directory is needed "
            "(--model DIR; rlstream model init makes one)"
        )
    tokenizer = load_json(Path(cfg.path) / "tokenizer.json", "tokenizer")
    return _config(cfg, None), tokenizer, _hf_tensors(cfg, params)


def export(cfg: ModelConfig, params: Any, out: Path, extra: dict[str, Any] | None = None) -> Path:
    """Write ``params`` of a model of ``cfg`` as a Hugging Face directory ``out`` (which
    must not exist or be empty): ``model.safetensors``, ``config.json`` and the tokenizer
    files of the checkpoint the model came from."""
    if out.exists() and any(out.iterdir()):
        raise InvalidConfigError(f"{out} is not empty")
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensorfile.write(tmp / SINGLE, dict(_hf_tensors(cfg, params)))
    source = Path(cfg.path) if cfg.path else None
    if source is not None:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)
    config = _config(cfg, extra)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    return out


def initial_model(cfg: ModelConfig, seed: int = 0, training: bool = False) -> Transformer:
    """The policy a process starts from: the weights of the checkpoint directory
    ``cfg.path`` when it names one, else a random initialization of ``seed``."""
    if cfg.path:
        return load_model(cfg, training)
    check_fits(cfg, training)
    return Transformer(cfg, nnx.Rngs(seed))
