"""Policy parameters on disk (orbax) and their content digest.

``save_params`` writes an orbax checkpoint of a model's parameters and returns once it is
durable; ``restore_params`` reads one back into the structure of a given model
(split → save → ``eval_shape`` → restore → merge); ``digest`` hashes every file of a
checkpoint, and ``snapshot`` copies one into a private directory while hashing it, so
that a reader restores exactly the bytes it verified.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx
from tenacity import (
    RetryCallState,
    retry,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from pipeline.errors import InvalidConfigError
from pipeline.policy.config import ModelConfig
from pipeline.policy.model import Transformer

log = logging.getLogger(__name__)

#: the file beside the parameters that names their policy version
VERSION_FILE = "rlstream.json"


def _log_retry(state: RetryCallState) -> None:
    """One line per retry, the error cut (tensorstore's carry kilobytes of spec)."""
    error = state.outcome.exception() if state.outcome is not None else None
    log.warning(
        "retrying %s in %.1f s error=%s: %s",
        getattr(state.fn, "__name__", "checkpoint I/O"),
        state.next_action.sleep if state.next_action is not None else 0.0,
        type(error).__name__,
        str(error)[:300],
    )


_io_retry = retry(
    # what the file system failed to do may work a moment later; files that are not a
    # checkpoint (orbax and tensorstore raise ValueError) will not, and are refused at once
    retry=retry_if_exception_type(OSError),
    stop=stop_after_attempt(3),
    wait=wait_exponential(multiplier=0.2, max=2),
    before_sleep=_log_retry,
    reraise=True,
)


class _OrbaxTasks(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for orbax's own read tasks:
    a failed restore raises once, with the reason; its sibling reads that failed too are
    not news (one such block per tensor filled a producer's log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("never retrieved" in message and "orbax" in message)


logging.getLogger("asyncio").addFilter(_OrbaxTasks())


@_io_retry
def save_params(
    path: Path, model: Transformer, version: int | None = None, write_version: bool = True
) -> Path:
    """Write the model's parameters to ``path`` (which must not exist) and wait until the
    checkpoint is durable. With ``version``, the policy version is written beside them
    (:data:`VERSION_FILE`), so that an announcement cannot claim another one. Processes
    of one JAX job call this together, each writing its shards; one of them writes the
    version file (``write_version``)."""
    state = nnx.state(model, nnx.Param)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path.absolute(), nnx.to_pure_dict(state))
        ckptr.wait_until_finished()
    if version is not None and write_version:
        meta = {"policy_version": version, "model_config": model.cfg.to_json()}
        (path / VERSION_FILE).write_text(json.dumps(meta))
    return path


def abstract_params(cfg: ModelConfig) -> Any:
    """The parameter structure of a model of ``cfg``, without allocating it."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    return nnx.state(abstract, nnx.Param)


@_io_retry
def restore_params(path: Path, cfg: ModelConfig) -> Any:
    """Parameters saved by :func:`save_params`, as an ``nnx.State`` for a model of ``cfg``
    (shapes are checked against it), on this process's first device whatever devices
    they were saved from."""
    target = abstract_params(cfg)
    # onto this process's first device, whatever mesh the checkpoint was saved from
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pure = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        nnx.to_pure_dict(target),
    )
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path.absolute(), pure)
    nnx.replace_by_pure_dict(target, restored)
    return jax.tree.map(lambda x: x, target)


def digest(path: Path) -> str:
    """``sha256:<hex>`` over the relative names and contents of every file under
    ``path`` (links followed), in sorted order."""
    return _hash_files(path, None, None)


def snapshot(path: Path, roots: Sequence[Path], into: Path) -> str:
    """Copy every file of the checkpoint at ``path`` into the empty directory ``into``
    while hashing the very bytes copied, and return their :func:`digest`: what is then
    restored from ``into`` is exactly what was hashed, whatever happens to ``path``
    meanwhile. A link anywhere in the tree that leads outside every one of ``roots``,
    a link loop, or an entry that is not a file or directory raises ValueError."""
    return _hash_files(path, [r.resolve() for r in roots], into)


def _hash_files(path: Path, roots: Sequence[Path] | None, into: Path | None) -> str:
    h = ContentDigest()
    out = None
    try:
        for rel, offset, _, data in file_chunks(path, roots, into=into):
            if offset == 0:
                h.file(rel)
                if out is not None:
                    out.close()
                out = (into / rel).open("xb") if into is not None else None
            h.update(data)
            if out is not None:
                out.write(data)
    finally:
        if out is not None:
            out.close()
    return h.hexdigest()


class ContentDigest:
    """The :func:`digest` of files given one after another in sorted order, piece by
    piece: ``file(name)`` before each file's bytes, ``update`` with them in order."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._open = False

    def file(self, rel: str) -> None:
        if self._open:
            self._h.update(b"\0")
        self._h.update(rel.encode() + b"\0")
        self._open = True

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        h = self._h.copy()
        if self._open:
            h.update(b"\0")
        return "sha256:" + h.hexdigest()


def file_chunks(
    path: Path,
    roots: Sequence[Path] | None = None,
    size: int = 1 << 20,
    into: Path | None = None,
) -> Iterator[tuple[str, int, int, bytes]]:
    """``(relative name, offset, file size, bytes)`` of every file under ``path`` in
    :func:`digest` order, at most ``size`` bytes at a time (an empty file gives one empty
    piece); ``roots`` and ``into`` as for :func:`snapshot`."""
    for rel, f in _walk(path, roots, into):
        with f.open("rb") as fh:
            total = os.fstat(fh.fileno()).st_size
            offset = 0
            while True:
                data = fh.read(size)
                if not data and offset:
                    break
                yield rel, offset, total, data
                offset += len(data)
                if not data:
                    break


def _walk(path: Path, roots: Sequence[Path] | None, into: Path | None) -> list[tuple[str, Path]]:
    """Every regular file under ``path`` as ``(relative name, path)``, sorted by name,
    following links to directories; with ``into``, its directories are made there."""
    files: list[tuple[str, Path]] = []
    seen: set[Path] = set()
    todo = [(path, "")]
    while todo:
        d, rel = todo.pop()
        real = d.resolve()
        if real in seen:
            raise ValueError(f"{d} is reached twice (a link loop)")
        seen.add(real)
        if into is not None:
            (into / rel).mkdir(parents=True, exist_ok=True)
        for entry in sorted(os.scandir(d), key=lambda e: e.name):
            p, name = Path(entry.path), rel + entry.name
            if entry.is_symlink() and roots is not None:
                target = p.resolve()
                if not any(target.is_relative_to(r) for r in roots):
                    raise ValueError(f"{name} links to {target}, outside the allowed roots")
            if p.is_dir():
                todo.append((p, name + "/"))
            elif p.is_file():
                files.append((name, p))
            else:
                raise ValueError(f"{name} is neither a file nor a directory")
    return sorted(files)


def find_weights(path: Path) -> Path:
    """The policy weights ``path`` names for a person: a ``weights/vN`` folder as it is; a
    run directory or its ``weights`` folder as its newest version; a trainer checkpoint
    ``checkpoints/N`` as the version it published. Anything else is an
    :class:`InvalidConfigError` that names the newest weights nearby, if any."""
    if (path / VERSION_FILE).is_file():
        return path
    if path.is_dir() and (path / "weights").is_dir():
        return _newest(path / "weights")
    if path.is_dir() and path.name == "weights":
        return _newest(path)
    if path.is_dir() and path.parent.name == "checkpoints" and path.name.isdigit():
        try:
            version = int(json.loads((path / "meta" / "metadata").read_text())["version"])
        except (OSError, ValueError, KeyError, TypeError):
            raise InvalidConfigError(f"{path} is not a trainer checkpoint rlstream wrote") from None
        published = path.parent.parent / "weights" / f"v{version}"
        if (published / VERSION_FILE).is_file():
            return published
        raise InvalidConfigError(
            f"the weights of checkpoint {path} (version {version}) are no longer kept"
            + _nearby(path.parent.parent)
        )
    raise InvalidConfigError(
        f"no policy weights at {path}"
        + _nearby(path)
        + "; give a run directory, its weights/vN or its checkpoints/N"
    )


def _versions(weights: Path) -> list[int]:
    return sorted(
        int(p.name[1:])
        for p in weights.glob("v*")
        if p.name[1:].isdigit() and (p / VERSION_FILE).is_file()
    )


def _newest(weights: Path) -> Path:
    versions = _versions(weights)
    if not versions:
        raise InvalidConfigError(f"{weights} holds no weights yet (the trainer publishes them)")
    return weights / f"v{versions[-1]}"


def _nearby(path: Path) -> str:
    """``"; the newest available is ..."`` for the run directory above ``path``."""
    for parent in [path, *path.parents][:4]:
        weights = parent if parent.name == "weights" else parent / "weights"
        if weights.is_dir() and _versions(weights):
            return f"; the newest available is {_newest(weights)}"
    return ""


def saved_model_config(path: Path) -> ModelConfig:
    """The model configuration written next to the parameters by :func:`save_params`."""
    f = path / VERSION_FILE
    if not f.is_file():
        raise ValueError(f"{path} has no {VERSION_FILE}: not a checkpoint rlstream wrote")
    try:
        return ModelConfig.from_json(json.loads(f.read_text()[:65536])["model_config"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{f} names no model configuration") from None


def saved_version(path: Path) -> int | None:
    """The policy version written next to the parameters by :func:`save_params`, or
    None when the checkpoint does not say."""
    f = path / VERSION_FILE
    if not f.is_file():
        return None
    text = f.read_text()[:4096]
    try:
        value = json.loads(text)["policy_version"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{VERSION_FILE} is malformed: {text[:200]!r}") from None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{VERSION_FILE} holds no integer version: {text[:200]!r}")
    return value
