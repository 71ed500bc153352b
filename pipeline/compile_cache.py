"""JAX's persistent compilation cache for rlstream's processes.

A trainer compiles its step for each batch shape before it trains, and a producer its
sampler; on two CPU cores that is seconds per shape, on a real model minutes. With the
cache, a process started again (a restart after a crash, the next run, a test) loads the
compiled programs from disk. The cache lives in ``RLSTREAM_COMPILE_CACHE`` (default
``$XDG_CACHE_HOME/rlstream/jax`` or ``~/.cache/rlstream/jax``; ``off`` disables it) and
is used only when it is a directory of this user that no one else may write: a
compilation cache is code that the process runs. ``JAX_COMPILATION_CACHE_DIR``, when set,
is left to JAX.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rlstream" / "jax"


def enable() -> Path | None:
    """Point JAX at the cache (before the first compile); the directory used, or None."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    setting = os.environ.get("RLSTREAM_COMPILE_CACHE", "")
    if setting.lower() in ("off", "0", "false", "no"):
        return None
    path = Path(setting) if setting else default_dir()
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = path.stat()
    except OSError as e:
        log.warning("compilation cache off: %s", e)
        return None
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.warning(
            "compilation cache off: %s is not this user's alone (chmod 700 it, or set "
            "RLSTREAM_COMPILE_CACHE)",
            path,
        )
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path
