"""Reading a run's files back: torn lines, restarted trainers, ledger ranges, config checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.errors import InvalidConfigError
from pipeline.launch.config import RunConfig
from pipeline.observe.report import (
    busy_series,
    busy_share,
    last_json,
    ledger_summary,
    trainer_metrics,
)
from pipeline.records.ledger import Ledger


def test_a_torn_last_line_is_left_for_the_next_read(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + "\n" + '{"st')
    assert last_json(path) == {"step": 2}
    assert last_json(tmp_path / "missing.jsonl") is None


def test_a_restarted_trainer_s_repeated_steps_count_once(tmp_path: Path) -> None:
    lines = [
        {"step": 1, "time": 0.0, "busy_s": 1.0, "idle_s": 1.0, "busy_share": 0.5},
        {"step": 2, "time": 1.0, "busy_s": 2.0, "idle_s": 1.0, "busy_share": 0.67},
        # restart: step 2 done again, timers start from zero
        {"step": 2, "time": 5.0, "busy_s": 0.5, "idle_s": 0.5, "busy_share": 0.5},
        {"step": 3, "time": 6.0, "busy_s": 1.5, "idle_s": 0.5, "busy_share": 0.75},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    metrics = trainer_metrics(tmp_path)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[1]["time"] == 5.0  # the line the durable state corresponds to
    xs, ys = busy_series(lines)
    assert ys == [1.0, 1.0]  # the interval across the restart is left out
    assert xs == [1.0, 6.0]
    assert busy_share(lines[2:]) == 1.0


def test_ledger_summary_counts_ranges_and_reasons(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.train("a", "t", 0, 5)
    ledger.train("b", "t", 0, 6)
    ledger.drop(None, "t", 0, 7, "stale")
    ledger.close_step(1, 1)
    ledger.drop_range("t", 1, 10, 50, "stale_range")
    ledger.drop("c", "t", 0, 8, "decode")
    ledger.close_step(1, 1)
    summary = ledger_summary(tmp_path)
    assert summary["trained"] == 2
    assert summary["dropped"] == {"stale": 1, "stale_range": 40, "decode": 1}
    assert summary["dropped_stale"] == 41
    assert summary["steps"] == 1


def test_run_settings_are_checked() -> None:
    with pytest.raises(InvalidConfigError, match="unknown environment"):
        RunConfig(env="nosuch")
    with pytest.raises(InvalidConfigError, match="whole groups"):
        RunConfig(sync=True, producers=3)
    with pytest.raises(InvalidConfigError):
        RunConfig(steps=0)
    assert RunConfig(sync=True, producers=2).rows == 64
