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
    headline,
    last_json,
    ledger_summary,
    paused_causes,
    paused_share,
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


def test_random_answers_baseline_of_guess() -> None:
    from connectors.base import make

    assert make("guess").random_success() == pytest.approx(1 - (7 / 8) ** 4)
    assert make("guess", high=2, max_turns=1).random_success() == pytest.approx(0.5)
    # calc: answers lie in [-18, 90] for operands up to 9, three turns
    assert make("calc").random_success() == pytest.approx(1 - (108 / 109) ** 3)
    assert make("calc", max_operand=999).random_success() < 1e-5


def test_headline_states_what_how_far_and_where_time_went() -> None:
    from pipeline.observe.report import headline

    figures = {
        "success_initial": 0.075,
        "success_final": 0.33,
        "random_success": 0.414,
        "eval_episodes": 200,
        "wall_s": 575.5,
        "pipeline_wall_s": 540.0,
        "trainer_busy": 0.845,
        "trajectories_dropped_stale": 12,
    }
    lines = [ln for ln in headline("a model on `guess`", figures, 0.25) if ln]
    assert len(lines) == 3
    # the gain over random answers first: this policy learned the format, not the task
    assert lines[1].startswith(
        "**Result:** held-out success 33.0% on 200 episodes, -8.4 points over random answers "
        "(41.4%); it went from 7.5% (+25.5 points)"
    )
    assert "busy 84% of its time" in lines[2] or "busy 85% of its time" in lines[2]
    assert "paused by admission control 25%" in lines[2] and "12 trajectories" in lines[2]
    # nothing evaluated, no baseline, no producers: said, not left blank
    bare = headline("x", {"wall_s": 3.0}, None)
    assert "not evaluated" in bare[2] and "random" not in bare[2]
    unknown = headline("x", {"success_final": 0.5, "eval_episodes": 10}, None)
    assert "no random baseline" in unknown[2]
    assert "paused" not in bare[4]


def test_episode_text_stays_one_line_per_turn_whatever_the_policy_wrote() -> None:
    import numpy as np

    from pipeline.observe.episodes import Sample, conversation, render
    from pipeline.policy.tokenizer import ByteTokenizer
    from pipeline.records.trajectory import Timings, Trajectory, Turn, VersionSpan

    tok = ByteTokenizer()
    prompt = tok.encode("Guess my number from 1 to 8.")
    answer = tok.encode("7\n```\x00\x1b[2J" + "x" * 1000)
    tokens = np.asarray(prompt + answer, dtype=np.int32)
    n, m = len(prompt), len(answer)
    t = Trajectory(
        "t", "g", 1, 0, "guess-1-8-7", "p", "guess", tok.id, tokens,
        np.asarray([0] * n + [1] * m, dtype=np.uint8), np.zeros(n + m, dtype=np.float32),
        [VersionSpan(n, n + m, 3)],
        [Turn("user", 0, n), Turn("assistant", n, n + m, "\x07tool")],
        1.0, {}, "ok", Timings(0, 1), {},
    )  # fmt: skip
    lines = conversation(t, tok, max_chars=50)
    assert lines[0] == "environment: Guess my number from 1 to 8."
    assert lines[1].startswith("policy (calls \\x07tool): 7\\n'''\\x00\\x1b[2J")
    assert lines[1].endswith("more characters)") and "\n" not in lines[1]
    assert lines[-1] == "(episode over: ok, reward 1)"
    text = render([Sample("best of the last step", 9, t)], tok)
    assert text[0].startswith("**best of the last step** (step 9): reward 1.00, ok")
    assert "policy version 3" in text[0]
    assert sum(1 for ln in text if ln.startswith("```")) == 2  # the block is never closed early


def test_an_empty_or_foreign_directory_is_refused_and_a_bare_run_still_plots(
    tmp_path: Path,
) -> None:
    from pipeline.launch.report import build_report
    from pipeline.observe.plots import Limits, render

    with pytest.raises(InvalidConfigError, match="neither config"):
        build_report(tmp_path, None)
    with pytest.raises(InvalidConfigError, match="not a directory"):
        build_report(tmp_path / "missing", None)
    # a run that trained nothing yet: every plot is drawn, empty but labelled
    made = render(tmp_path, Limits(start_time=0.0, max_staleness=2, admission_budget=128))
    assert len(made) == 6
    for _, rel in made:
        assert (tmp_path / rel).stat().st_size > 1000
    # metrics with NaN and missing figures plot too
    rows = [
        {"step": 1, "version": 1, "time": 10.0, "loss": float("nan"), "reward": {"guess": 0.5},
         "success": {"guess": 0.0}, "staleness_hist": {"0": 8}, "lag": 3, "busy_s": 1.0,
         "idle_s": 0.0, "busy_share": 1.0, "staleness_mean": 0.0},
        {"step": 2, "version": 2, "time": 11.0, "reward": {"guess": float("nan")},
         "success": {}, "staleness_hist": {}, "busy_s": 1.5, "idle_s": 0.5,
         "busy_share": 0.75, "staleness_mean": 1.0},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # two producers' status lines, one per second, one of them with a torn last line
    (tmp_path / "producers").mkdir()
    for name, n in (("producer-0", 90), ("producer-1", 3)):
        status = [
            {"time": 5.0 + i, "episodes": 4 * i, "in_flight": 8, "lag": i % 7, "version": i // 30}
            for i in range(n)
        ]
        text = "".join(json.dumps(r) + "\n" for r in status)
        (tmp_path / "producers" / f"{name}.jsonl").write_text(text + '{"time": ')
    made = render(tmp_path, Limits(start_time=0.0, max_staleness=2, evals=((0, 0.1), (2, 0.2))))
    assert len(made) == 6


def test_report_refuses_a_directory_that_is_no_run_before_connecting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    import time

    from pipeline.cli.main import main

    start = time.monotonic()
    assert main(["report", str(tmp_path), "--bootstrap", "127.0.0.1:1"]) == 2
    assert main(["report", str(tmp_path / "nothing"), "--bootstrap", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "neither config.json (written by rlstream run) nor trainer.json" in err
    assert "nothing is not a directory" in err
    assert time.monotonic() - start < 5  # no connection was tried
    assert not any("waiting for Kafka" in r.getMessage() for r in caplog.records)


def test_the_paused_share_is_time_weighted_by_each_producer_s_clock() -> None:
    """Status lines carry seconds paused and running: a producer paused for 30 of 60 s
    and one never paused make 25%, whatever share of their snapshots said paused; files
    without those fields fall back to the snapshots."""
    snapshots = [{"paused": True}] * 9 + [{"paused": False}]
    timed = {
        "producer-0": [*snapshots, {"paused": False, "paused_s": 30.0, "running_s": 60.0}],
        "producer-1": [*snapshots, {"paused": True, "paused_s": 0.0, "running_s": 60.0}],
    }
    assert paused_share(timed) == 0.25
    assert paused_share({"producer-0": snapshots}) == 0.9
    for bad in ("x", None, float("nan"), -1.0, 61.0):  # unreadable or impossible: skipped
        broken = {**timed, "producer-2": [{"paused": True, "paused_s": bad, "running_s": 60.0}]}
        assert paused_share(broken) == 0.25
    assert paused_share({}) is None


def test_the_paused_time_is_split_by_its_cause() -> None:
    """Each producer's last status line says how long each cause held it back: the
    shares are seconds over the producers' running time together, and the headline names
    them; hostile lines (not a mapping, NaN, negative, longer than running) are skipped."""
    producers = {
        "producer-0": [
            {"running_s": 60.0, "paused_by": {"untrained": 30.0, "in_flight": 6.0}},
        ],
        "producer-1": [
            {"running_s": 60.0, "paused_by": {"weights_behind": 12.0, "joining": 0.0}},
        ],
    }
    causes = paused_causes(producers)
    assert causes == {"untrained": 0.25, "in_flight": 0.05, "weights_behind": 0.1, "joining": 0}
    line = headline("x", {"wall_s": 1.0}, 0.4, causes)[-1]
    assert "(by records the trainer had not read 25%, by episodes in flight 5%, by " in line
    for bad in ("x", None, {"untrained": float("nan")}, {"in_flight": -1}, {"untrained": 61}):
        broken = {**producers, "producer-2": [{"running_s": 60.0, "paused_by": bad}]}
        assert paused_causes(broken) == causes
    assert paused_causes({"p": [{"paused": True}]}) == {}
