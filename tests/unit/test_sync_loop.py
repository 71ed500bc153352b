"""The synchronous loop without Kafka that ``bench async`` compares the pipeline with."""

from __future__ import annotations

from pathlib import Path

from pipeline.bench import sync_loop
from pipeline.launch.config import RunConfig


def test_each_batch_is_sampled_with_the_previous_steps_parameters(tmp_path: Path) -> None:
    cfg = RunConfig(steps=3, sync=True, groups_per_batch=2, group_size=4, concurrency=8)
    out = sync_loop.run(cfg, tmp_path, checkpoint_every=2)
    # the parameters reach the engine in memory: step k samples version k - 1, never older
    assert out["versions"] == [0, 1, 2]
    assert out["steps_measured"] == 2 and len(out["batch_success"]) == 3
    # the trainer's state saved every 2 steps and at the last
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [2, 3]
    parts = [out[k] for k in ("generate_s", "train_s", "swap_s", "checkpoint_s")]
    assert all(p >= 0 for p in parts) and out["train_s"] > 0
    assert sum(parts) <= out["wall_s"] + 0.02 and 0 < out["trainer_busy"] <= 1  # rounded to 10 ms
