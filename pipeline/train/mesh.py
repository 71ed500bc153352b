"""The trainer's device mesh: parameters, optimizer state and batch sharded over named axes.

Two axes: ``fsdp`` (the batch's rows are split over it, and every weight matrix along one
of its dimensions: fully sharded data parallel) and ``tensor`` (each layer's heads and
feed-forward width, and the vocabulary, split over it: tensor parallel). The rules go by
kind of layer, by the parameter's name, so they hold for the built-in policy and for the
Llama and Qwen families alike, and for the optimizer state, whose leaves carry the same
names as the parameters they follow:

================  ====================  ===========================================
layer             kernel ``[in, out]``  why
================  ====================  ===========================================
q, k, v, gate, up ``(fsdp, tensor)``    column parallel: heads / width split
out, down         ``(tensor, fsdp)``    row parallel: the partial sums are reduced
embed ``[V, D]``  ``(tensor, fsdp)``    vocabulary split
lm_head           ``(fsdp, tensor)``    vocabulary split
biases            ``(tensor,)``         follow their kernel's output
norms, scalars    replicated
================  ====================  ===========================================

A dimension the axis does not divide is left whole (a tiny model on four devices still
runs). On CPU, ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` gives N devices.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipeline.errors import InvalidConfigError

AXES = ("fsdp", "tensor")

_COLUMN = {"q", "k", "v", "gate", "up", "lm_head"}
_ROW = {"out", "down"}


def make_mesh(fsdp: int, tensor: int, devices: list[Any] | None = None) -> Mesh:
    """A ``fsdp x tensor`` mesh over the first ``fsdp * tensor`` of ``devices`` (default:
    this process's); ``fsdp`` 0 takes every device the tensor axis leaves."""
    devices = devices if devices is not None else jax.devices()
    if tensor < 1 or fsdp < 0:
        raise InvalidConfigError(f"mesh axes must be positive, got fsdp={fsdp} tensor={tensor}")
    if fsdp == 0:
        fsdp = max(1, len(devices) // tensor)
    if fsdp * tensor > len(devices):
        raise InvalidConfigError(
            f"a mesh of fsdp={fsdp} x tensor={tensor} needs {fsdp * tensor} devices; this "
            f"process has {len(devices)} (on CPU, XLA_FLAGS="
            f"--xla_force_host_platform_device_count=N makes N)"
        )
    return Mesh(np.asarray(devices[: fsdp * tensor]).reshape(fsdp, tensor), AXES)


def _names(path: tuple[Any, ...]) -> list[str]:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    while out and out[-1] == "value":  # an nnx Variable's array
        out.pop()
    return out


def spec_for(path: tuple[Any, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """The partition of the parameter (or optimizer-state leaf) at ``path``."""
    names = _names(path)
    leaf = names[-1] if names else ""
    layer = names[-2] if len(names) > 1 else ""
    if leaf == "kernel" and len(shape) == 2:
        axes: tuple[str | None, ...] = (
            ("fsdp", "tensor") if layer in _COLUMN else ("tensor", "fsdp")
        )
        if layer not in _COLUMN | _ROW:
            axes = (None, None)
    elif leaf == "embedding" and len(shape) == 2:
        axes = ("tensor", "fsdp")
    elif leaf == "bias" and len(shape) == 1 and layer in _COLUMN:
        axes = ("tensor",)
    else:
        axes = (None,) * len(shape)
    fitted = [
        a if a is not None and dim % mesh.shape[a] == 0 else None
        for a, dim in zip(axes, shape, strict=True)
    ]
    return PartitionSpec(*fitted)


def state_shardings(tree: Any, mesh: Mesh) -> Any:
    """A :class:`NamedSharding` for every array leaf of ``tree`` (parameters, optimizer
    state, a whole train state), by :func:`spec_for`."""

    def one(path: tuple[Any, ...], leaf: Any) -> Any:
        shape = tuple(getattr(leaf, "shape", ()))
        return NamedSharding(mesh, spec_for(path, shape, mesh))

    return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows of a batch split over ``fsdp``, replicated over ``tensor``."""
    return NamedSharding(mesh, PartitionSpec("fsdp"))


def shard(tree: Any, shardings: Any) -> Any:
    return jax.device_put(tree, shardings)
