"""Where rlstream's processes keep compiled programs, and where they refuse to."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import pytest

from pipeline import compile_cache


def test_a_cache_others_may_write_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("RLSTREAM_COMPILE_CACHE", str(shared))
    before = jax.config.jax_compilation_cache_dir
    assert compile_cache.enable() is None
    assert "not this user's alone" in caplog.text
    assert jax.config.jax_compilation_cache_dir == before
    monkeypatch.setenv("RLSTREAM_COMPILE_CACHE", "off")
    assert compile_cache.enable() is None


def test_the_cache_directory_is_made_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    before = jax.config.jax_compilation_cache_dir
    own = tmp_path / "a" / "cache"
    monkeypatch.setenv("RLSTREAM_COMPILE_CACHE", str(own))
    try:
        assert compile_cache.enable() == own
        assert own.stat().st_mode & 0o777 == 0o700 and own.stat().st_uid == os.getuid()
        assert jax.config.jax_compilation_cache_dir == str(own)
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
