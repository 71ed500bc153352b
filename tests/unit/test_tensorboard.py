"""Event files written by rlstream, read back by TensorBoard's own reader."""

from __future__ import annotations

import math
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipeline.observe.tensorboard import ScalarWriter, flatten


def test_scalars_read_back_by_tensorboard(tmp_path: Path) -> None:
    first = ScalarWriter(tmp_path)
    for step in range(1, 6):
        first.write(step, {"train/loss": 1 / step, "train/reward/guess": step / 10}, 100.0 + step)
    second = ScalarWriter(tmp_path)  # a restarted process: a second file, same folder
    second.write(6, {"train/loss": 1 / 6, "eval/success": 0.25}, 106.0)
    assert first.path != second.path
    acc = EventAccumulator(str(tmp_path))  # the folder, as `tensorboard --logdir` reads it
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5, 6]
    for e in loss:
        assert math.isclose(e.value, 1 / e.step, rel_tol=1e-6)
        assert e.wall_time == 100.0 + e.step
    assert [e.value for e in acc.Scalars("eval/success")] == [0.25]
    acc = EventAccumulator(str(first.path))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["train/loss", "train/reward/guess"]
    assert [round(e.value, 6) for e in acc.Scalars("train/reward/guess")] == [
        0.1,
        0.2,
        0.3,
        0.4,
        0.5,
    ]


def test_flatten_keeps_finite_numbers_only() -> None:
    row = {
        "step": 3,
        "loss": 0.5,
        "ok": True,
        "name": "x",
        "bad": float("nan"),
        "inf": float("inf"),
        "reward": {"guess": 0.25, "calc": {"deep": -1}},
    }
    assert flatten(row, "train") == {
        "train/step": 3.0,
        "train/loss": 0.5,
        "train/reward/guess": 0.25,
        "train/reward/calc/deep": -1.0,
    }
