"""Decode-step attention on CPU as a native kernel (``_attention_native.cc``).

XLA compiles the decode step's attention into two batched products of
``batch x kv_heads`` small matrices each, and runs every one of them as a call of its
own: for the 0.5B shape at 64 rows this took about a third of a decode step. The kernel
reads each cached key and value once per row and head, only up to the row's position,
on XLA's intra-op thread pool.

It is compiled on first use with the machine's C++ compiler against the XLA FFI headers
that jaxlib ships (``-O3 -march=native``: the .so is kept per source, jaxlib version and
CPU under ``$XDG_CACHE_HOME/rlstream/native``, else the temporary folder). Where there is
no compiler, the build fails or ``RLSTREAM_NATIVE_ATTENTION=0`` is set, the model uses its
einsum path, which computes the same thing (tests/unit/test_native_attention.py compares the two).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_attention_native.cc")
TARGET = "rlstream_decode_attention"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC")  # fmt: skip

_lock = threading.Lock()
_state: dict[str, bool] = {}


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _library_path() -> Path:
    import jaxlib

    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), jaxlib.__version__.encode(), " ".join(FLAGS).encode(),
                 _cpu_signature().encode()):  # fmt: skip
        key.update(part)
    name = f"attention-{key.hexdigest()[:16]}.so"
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlstream" / "native"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: the machine's temporary folder, per user
        root = Path(tempfile.gettempdir()) / f"rlstream-native-{os.getuid()}"
    return root / name


def _build(target: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (set CXX or install g++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    # built beside the target and renamed: processes building at once never load half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            errors = [ln for ln in done.stderr.splitlines() if "error" in ln] or ["no output"]
            raise RuntimeError(f"{Path(compiler).name} exited {done.returncode}: {errors[0]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def available() -> bool:
    """Whether the kernel is built and registered with XLA (building it on first call).

    False, with one warning, where it cannot be built; False without one where
    ``RLSTREAM_NATIVE_ATTENTION=0`` turns it off."""
    if os.environ.get("RLSTREAM_NATIVE_ATTENTION", "1") == "0":
        return False
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
        return _state["ok"]


def _load() -> bool:
    try:
        path = _library_path()
        if not path.exists():
            _build(path)
        library = ctypes.cdll.LoadLibrary(str(path))
        handler = jax.ffi.pycapsule(library.RlstreamDecodeAttention)
        jax.ffi.register_ffi_target(TARGET, handler, platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
        log.warning("decode attention: native kernel not used, einsum path instead (%s)", exc)
        return False
    return True


def usable(q: jax.Array, cache: jax.Array) -> bool:
    """Whether a decode step with these arrays can run on the kernel: one query token per
    row, float32, on CPU, the kernel built."""
    return (
        q.ndim == 5
        and q.shape[3] == 1
        and q.dtype == jnp.float32
        and cache.dtype == jnp.float32
        and jax.default_backend() == "cpu"
        and available()
    )


def decode_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array
) -> jax.Array:
    """``q [B, K, G, 1, D]`` against caches ``[B, K, S, D]`` up to ``positions [B]``
    (inclusive) -> ``[B, 1, K, G, D]``, as the einsum path's ``bqkgd``."""
    b, k, g, _, d = q.shape
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((b, k, g, d), jnp.float32))
    y = call(q.reshape(b, k, g, d), k_cache, v_cache, positions.astype(jnp.int32))
    return y.reshape(b, 1, k, g, d)
