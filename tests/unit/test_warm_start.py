"""A run's warm start (demonstrations, a new checkpoint, SFT before RL): its settings
refused by name before any work, its finished stages reused, a failed or stopped stage
reported with its reason."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.errors import InvalidConfigError, RlstreamError
from pipeline.launch.config import RunConfig
from pipeline.launch.warm_start import WarmStartConfig, model_dir, prepare
from pipeline.policy.hf_init import init_checkpoint
from pipeline.settings import resolve

CALC = {"env": "calc"}


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({**CALC, "warm_start": {"demos": -1}}, "warm_start.demos must be 0 or more"),
        ({**CALC, "warm_start": {"demos": 5, "family": "gpt2"}}, "warm_start.family 'gpt2'"),
        ({**CALC, "warm_start": {"demos": 5, "preset": "huge"}}, "warm_start.preset 'huge'"),
        ({**CALC, "warm_start": {"demos": 5, "sft": {"data": "x.jsonl"}}}, "warm start's own"),
        ({**CALC, "warm_start": {"demos": 5, "sft": {"seed": 3}}}, "warm start's own"),
        ({**CALC, "warm_start": {"demos": 5, "sft": {"epoch": 3}}}, "epoch"),
        ({**CALC, "warm_start": {"demos": 5, "sft": {"epochs": 0}}}, "epochs"),
        ({**CALC, "warm_start": {"demos": 5, "sft": {"learning_rate": "fast"}}}, "learning_rate"),
        ({**CALC, "warm_start": {"demos": 5}, "model": "small"}, "leave model unset"),
        ({"env": "guess", "warm_start": {"demos": 5}}, "'guess' has no scripted solver"),
        ({**CALC, "warm_start": {"demos": 5, "pretrain": {"guess": 5}}}, "'guess' has no"),
        ({**CALC, "warm_start": {"demos": 5, "pretrain": {"echo": 0}}}, "'echo' needs a count"),
        ({**CALC, "warm_start": {"demos": 5, "pretrain": {"nope": 5}}}, "unknown environment"),
        (
            {**CALC, "warm_start": {"demos": 5, "pretrain_sft": {"model": "x"}}},
            r"warm_start\.pretrain_sft: model are the warm start's own",
        ),
        ({**CALC, "warm_start": {"demos": 5, "pretrain_sft": {"rows": -1}}}, "rows"),
    ],
)
def test_a_bad_warm_start_is_refused_by_name(settings: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidConfigError, match=says):
        resolve(RunConfig, settings)


def test_a_warm_started_run_starts_from_what_sft_wrote() -> None:
    cfg = resolve(RunConfig, {**CALC, "warm_start": {"demos": 5, "sft": {"epochs": 2}}})
    assert cfg.warm_start.enabled and dict(cfg.warm_start.sft) == {"epochs": 2}
    assert not resolve(RunConfig, CALC).warm_start.enabled


def _done(run_dir: Path, tiny: Path) -> None:
    """A warm start whose every stage has finished."""
    warm = run_dir / "warm_start"
    warm.mkdir(parents=True)
    (warm / "demos.jsonl").write_text('{"messages": []}\n' * 3)
    shutil.copytree(tiny, warm / "init")
    shutil.copytree(tiny, warm / "sft" / "model")
    (warm / "sft" / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')


def test_finished_stages_are_reused_and_a_failed_one_says_why(tmp_path: Path) -> None:
    tiny = init_checkpoint(tmp_path / "tiny", "qwen3", "tiny", seed=0)
    ws = WarmStartConfig(demos=3)
    said: list[str] = []
    run_dir = tmp_path / "done"
    _done(run_dir, tiny)
    model = prepare(ws, "calc", {}, 0, run_dir, said.append, threading.Event())
    assert model.path == str(model_dir(run_dir)) and model.family == "qwen3"
    assert not (run_dir / "logs").exists()  # no stage was run again
    summary = json.loads((run_dir / "warm_start" / "summary.json").read_text())
    assert summary["demos_written"] == 3 and summary["sft_loss_final"] == 0.5
    assert "SFT 1 steps to loss 0.500" in said[-1]
    # a partial checkpoint is started over: its stage runs (and here fails, guess has no
    # solver), the reason in the error, the log kept
    failing = tmp_path / "failing"
    with pytest.raises(RlstreamError, match=r"demos stage failed[\s\S]*no scripted solver"):
        prepare(ws, "guess", {}, 0, failing, said.append, threading.Event())
    assert (failing / "logs" / "warm-start-demos.log").is_file()


def test_a_stop_ends_a_running_stage(tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    start = time.monotonic()
    with pytest.raises(RlstreamError, match="stopped during the warm start's demos stage"):
        prepare(WarmStartConfig(demos=3), "calc", {}, 0, tmp_path / "r", print, stop)
    assert time.monotonic() - start < 30
    assert not (tmp_path / "r" / "warm_start" / "demos.jsonl").exists()
