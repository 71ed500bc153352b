"""Policy parameters on disk (orbax) and their content digest.

``save_params`` writes an orbax checkpoint of a model's parameters and returns once it is
durable; ``restore_params`` reads one back into the structure of a given model
(split → save → ``eval_shape`` → restore → merge); ``digest`` hashes every file of a
checkpoint so that a reader can verify it is loading exactly what was announced.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx
from tenacity import before_sleep_log, retry, stop_after_attempt, wait_exponential

from pipeline.model import ModelConfig, Transformer

log = logging.getLogger(__name__)

_io_retry = retry(
    stop=stop_after_attempt(3),
    wait=wait_exponential(multiplier=0.2, max=2),
    before_sleep=before_sleep_log(log, logging.WARNING),
    reraise=True,
)


@_io_retry
def save_params(path: Path, model: Transformer) -> Path:
    """Write the model's parameters to ``path`` (which must not exist) and wait until the
    checkpoint is durable."""
    state = nnx.state(model, nnx.Param)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path.absolute(), nnx.to_pure_dict(state))
        ckptr.wait_until_finished()
    return path


def abstract_params(cfg: ModelConfig) -> Any:
    """The parameter structure of a model of ``cfg``, without allocating it."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    return nnx.state(abstract, nnx.Param)


@_io_retry
def restore_params(path: Path, cfg: ModelConfig) -> Any:
    """Parameters saved by :func:`save_params`, as an ``nnx.State`` for a model of ``cfg``
    (shapes are checked against it)."""
    target = abstract_params(cfg)
    pure = nnx.to_pure_dict(target)
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path.absolute(), pure)
    nnx.replace_by_pure_dict(target, restored)
    return jax.tree.map(lambda x: x, target)


def digest(path: Path) -> str:
    """``sha256:<hex>`` over the relative names and contents of every file under
    ``path``, in sorted order."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(path)).encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()
