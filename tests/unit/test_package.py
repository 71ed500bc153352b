"""The built wheel carries the schemas, so an installed rlstream finds them without the
source tree."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _build_wheel(tmp_path: Path, env: dict[str, str] | None = None, root: Path = ROOT) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(root),
        ],
        check=True,
        timeout=300,
        env=env,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("rlstream-*.whl")
    return wheel


def _run_installed(wheel: Path, tmp_path: Path) -> str:
    """Encode a trajectory with rlstream unpacked from ``wheel``, away from the source
    tree; the record's size and whether the C codec ran."""
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = (
        "import pipeline, sys; assert pipeline.__file__.startswith(sys.argv[1]), pipeline.__file__;"
        "from pipeline.records.codec import TrajectoryCodec;"
        "from pipeline.testing import make_trajectory;"
        "c = TrajectoryCodec(); t = make_trajectory(8);"
        "assert c.decode(c.encode(t)).tokens.tolist() == t.tokens.tolist();"
        "print(len(c.encode(t)), c.native)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(target)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def test_wheel_ships_schemas_and_works_without_the_source_tree(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    for schema in ("Trajectory", "Tensor", "WeightsAnnouncement", "WeightsChunk", "DeadLetter"):
        assert f"pipeline/schemas/{schema}.avsc" in names
    assert "pipeline/py.typed" in names and "pipeline/kafka_runtime/pom.xml" in names
    assert "pipeline/policy/_attention_native.cc" in names  # compiled on first use
    assert not any(n.endswith(".jar") for n in names)
    for module in ("_avro_native", "_contract_native"):  # the C codec, compiled
        assert any(n.startswith(f"pipeline/records/{module}.") and n.endswith(".so") for n in names)
    size, native = _run_installed(wheel, tmp_path).split()
    assert int(size) > 0 and native == "True"


def test_without_a_c_compiler_the_wheel_builds_and_runs_the_python_codec(tmp_path: Path) -> None:
    # a copy of the sources: the tree's own build/ holds objects compiled before
    source = tmp_path / "src"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).exists() or (ROOT / name).is_symlink():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name, follow_symlinks=False)
    wheel = _build_wheel(tmp_path, dict(os.environ, CC="/bin/false"), source)
    assert not any(n.endswith(".so") for n in zipfile.ZipFile(wheel).namelist())
    size, native = _run_installed(wheel, tmp_path).split()
    assert int(size) > 0 and native == "False"


def test_an_editable_install_prints_no_warning(tmp_path: Path) -> None:
    """``pip install -e .`` builds through ``build_editable``: no package-dir remapping, so
    setuptools has nothing to warn about (it did while schemas/ was remapped)."""
    code = (
        "import sys, warnings; warnings.simplefilter('always');"
        "from setuptools import build_meta;"
        "build_meta.build_editable(sys.argv[1])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # (a Python warning: SetuptoolsDeprecationWarning, BuildBackendWarning, ...)
    assert not re.search(r"\w+Warning\b", out.stdout + out.stderr), out.stderr[-2000:]
    assert len(list(tmp_path.glob("rlstream-*.editable-*.whl"))) == 1


def test_version_names_rlstream_and_its_libraries(capsys: object) -> None:
    import pytest

    from pipeline import __version__
    from pipeline.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # type: ignore[attr-defined]
    assert out.startswith(f"rlstream {__version__} (jax ")
    assert re.search(r"confluent-kafka \d+\.\d+", out) and "Python 3." in out
    assert re.search(r"kafka \(local broker\) 4\.\d+\.\d+", out)
    assert "record codec C;" in out  # compiled at install


def test_an_unexpected_error_is_one_sentence_unless_debug(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.cli import env
    from pipeline.cli.main import main

    def broken(args: object) -> int:
        raise ValueError("a value nobody checked")

    monkeypatch.setattr(env, "cmd_env", broken)
    monkeypatch.delenv("RLSTREAM_DEBUG", raising=False)
    assert main(["env", "list"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "unexpected error: ValueError: a value nobody checked" in err and "--debug" in err
    with pytest.raises(ValueError, match="nobody checked"):
        main(["--debug", "env", "list"])
    monkeypatch.setenv("RLSTREAM_DEBUG", "1")  # how rlstream run starts its children
    with pytest.raises(ValueError):
        main(["env", "list"])
