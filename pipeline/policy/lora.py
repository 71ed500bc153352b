"""LoRA: low-rank adapters on the policy's linear layers, merged into a copy of the base
parameters, saved and restored.

Adapters are a flat mapping ``{"blocks.<i>.<layer>": {"a": [in, r], "b": [r, out]}}`` in
float32, ``B`` zero at first so that the adapted policy starts as the base.
:func:`merged` is the policy they make, every target kernel ``W + alpha / r * A @ B`` in
``W``'s dtype: the trainer computes it inside its jitted step (the optimizer holds state
for the adapters alone), a producer once per announcement (sampling then runs as fast as
with full weights).

On disk an adapter checkpoint (:func:`save_adapters`) is an orbax checkpoint of the
adapters with a ``rlstream.json`` naming its policy version, the model, the LoRA settings
and the base they apply to (its URI and digest); the base is an ordinary parameter
checkpoint (:func:`pipeline.policy.checkpoint.save_params`), written once.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from pipeline.errors import InvalidConfigError
from pipeline.policy.checkpoint import VERSION_FILE, restore_params
from pipeline.policy.config import LoRAConfig, ModelConfig

Adapters = dict[str, dict[str, jax.Array]]


def layers(cfg: ModelConfig, lora: LoRAConfig) -> dict[str, tuple[int, int]]:
    """``{"blocks.<i>.<layer>": (in, out)}``: the kernels of ``cfg`` that get adapters."""
    d, hd = cfg.d_model, cfg.head_dim
    sizes = {
        "q": (d, cfg.num_heads * hd),
        "k": (d, cfg.kv_heads * hd),
        "v": (d, cfg.kv_heads * hd),
        "out": (cfg.num_heads * hd, d),
        "gate": (d, cfg.d_ff),
        "up": (d, cfg.d_ff),
        "down": (cfg.d_ff, d),
    }
    names = [n for n in lora.targets if n != "gate" or cfg.gated]
    if not names:
        raise InvalidConfigError(
            f"none of the LoRA targets {list(lora.targets)} is a layer of this model "
            "(gate exists only in the llama and qwen families)"
        )
    return {f"blocks.{i}.{n}": sizes[n] for i in range(cfg.num_layers) for n in names}


def init_adapters(cfg: ModelConfig, lora: LoRAConfig, seed: int = 0) -> Adapters:
    """Fresh adapters: ``A`` uniform in ``±1 / sqrt(in)``, ``B`` zero."""
    key = jax.random.key(seed)
    out: Adapters = {}
    for n, (name, (fan_in, fan_out)) in enumerate(sorted(layers(cfg, lora).items())):
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(
            jax.random.fold_in(key, n), (fan_in, lora.rank), jnp.float32, -bound, bound
        )
        out[name] = {"a": a, "b": jnp.zeros((lora.rank, fan_out), jnp.float32)}
    return out


def abstract_adapters(cfg: ModelConfig, lora: LoRAConfig) -> Any:
    """The shapes of adapters of ``cfg`` and ``lora``, without allocating them."""
    return {
        name: {
            "a": jax.ShapeDtypeStruct((fan_in, lora.rank), jnp.float32),
            "b": jax.ShapeDtypeStruct((lora.rank, fan_out), jnp.float32),
        }
        for name, (fan_in, fan_out) in layers(cfg, lora).items()
    }


def merged(params: Any, adapters: Adapters, scale: float) -> Any:
    """A copy of the parameters ``params`` (an ``nnx.State``) with every adapted kernel
    ``W + scale * A @ B`` (usable under jit; ``params`` is left as it was)."""
    out = jax.tree.map(lambda x: x, params)
    for name, ab in adapters.items():
        _, block, layer = name.split(".")
        kernel = out["blocks"][int(block)][layer]["kernel"]
        w = kernel[...]
        kernel[...] = w + (scale * (ab["a"] @ ab["b"])).astype(w.dtype)
    return out


def save_adapters(
    path: Path,
    adapters: Adapters,
    version: int,
    cfg: ModelConfig,
    lora: LoRAConfig,
    base: Path,
    base_digest: str,
    write_version: bool = True,
) -> Path:
    """Write the adapters to ``path`` (which must not exist) as an orbax checkpoint and,
    beside them, what they are: their version, the model, the LoRA settings and the base
    checkpoint (URI and digest) they apply to. Processes of one JAX job call this
    together; one of them writes the description (``write_version``)."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path.absolute(), adapters)
        ckptr.wait_until_finished()
    if write_version:
        meta = {
            "policy_version": version,
            "model_config": cfg.to_json(),
            "lora": lora.to_json(),
            "base": {"uri": str(base.absolute()), "digest": base_digest},
        }
        (path / VERSION_FILE).write_text(json.dumps(meta))
    return path


def adapter_meta(path: Path) -> tuple[LoRAConfig, str, str] | None:
    """``(settings, base URI, base digest)`` of the adapter checkpoint at ``path``; None
    for a checkpoint of full parameters. ValueError for a description that is not one."""
    f = path / VERSION_FILE
    if not f.is_file():
        return None
    try:
        meta = json.loads(f.read_text()[:65536])
        if "lora" not in meta:
            return None
        base = meta["base"]
        uri, digest = base["uri"], base["digest"]
        if not isinstance(uri, str) or not isinstance(digest, str):
            raise TypeError("base uri and digest must be strings")
        return LoRAConfig.from_json(meta["lora"]), uri, digest
    except (ValueError, KeyError, TypeError, InvalidConfigError) as e:
        raise ValueError(f"{f} does not describe an adapter checkpoint: {e}") from None


def restore_adapters(path: Path, cfg: ModelConfig, lora: LoRAConfig) -> Adapters:
    """Adapters saved by :func:`save_adapters` for a model of ``cfg`` (shapes checked),
    on this process's first device."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        abstract_adapters(cfg, lora),
    )
    with ocp.StandardCheckpointer() as ckptr:
        return dict(ckptr.restore(path.absolute(), target))


def restore_weights(path: Path, cfg: ModelConfig) -> Any:
    """The policy saved at ``path``: full parameters, or adapters merged into the base
    checkpoint they name (read from where it lies)."""
    meta = adapter_meta(path)
    if meta is None:
        return restore_params(path, cfg)
    lora, base, _ = meta
    return merged(restore_params(Path(base), cfg), restore_adapters(path, cfg, lora), lora.scale)
