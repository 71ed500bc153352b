"""The built wheel carries the schemas, so an installed rlstream finds them without the
source tree."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_schemas_and_works_without_the_source_tree(tmp_path: Path) -> None:
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
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("rlstream-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for schema in ("Trajectory", "Tensor", "WeightsAnnouncement", "DeadLetter", "Telemetry"):
        assert f"pipeline/schemas/{schema}.avsc" in names
    assert "pipeline/py.typed" in names and "pipeline/kafka_runtime/pom.xml" in names
    assert not any(n.endswith(".jar") for n in names)

    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = (
        "import pipeline, sys; assert pipeline.__file__.startswith(sys.argv[1]), pipeline.__file__;"
        "from pipeline.records.codec import TrajectoryCodec;"
        "from pipeline.testing import make_trajectory;"
        "c = TrajectoryCodec(); print(len(c.encode(make_trajectory(8))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(target)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(out.stdout) > 0


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
