"""``rlstream run`` against the real broker: separate processes, report, interruption,
a child's failure."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline.records.ledger import read_ledger
from tests.conftest import free_port_pair
from tests.integration.test_broker import rlstream
from tests.integration.test_cli import last_json

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SHORT = [
    "--groups-per-batch=2",
    "--group-size=4",
    "--concurrency=16",
    "--eval-episodes=16",
    "--partitions=2",
]


def run_command(bootstrap: str, run_dir: Path, *flags: str) -> list[str]:
    """``rlstream run`` on ``bootstrap`` into ``run_dir``, its result as JSON."""
    return [
        sys.executable,
        "-m",
        "pipeline.cli",
        "run",
        f"--bootstrap={bootstrap}",
        f"--run-dir={run_dir}",
        "--json",
        *flags,
    ]


def run_args(bootstrap: str, run_dir: Path, *extra: str) -> list[str]:
    return run_command(bootstrap, run_dir, *SHORT, *extra)


def start_long_run(bootstrap: str, run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    """A run far longer than the test, to be interrupted, broken or killed."""
    return subprocess.Popen(
        [*run_args(bootstrap, run_dir), "--steps=1000", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


PLOTS = ("learning", "training", "staleness", "trainer_busy", "lag", "versions")


def assert_plots(run_dir: Path, report: str) -> None:
    """Every plot is in the report, a PNG, and not blank (many distinct pixel values)."""
    import matplotlib.image as mpimg
    import numpy as np

    for name in PLOTS:
        png = run_dir / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"plots/{name}.png" in report
        pixels = mpimg.imread(png)
        assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 50, name


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has exited; only a parent that has not reaped it keeps it
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[-1][:1] != "Z"


def processes_of(run_dir: Path) -> list[int]:
    """Every process on the machine whose command line names the run directory."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(run_dir) in cmd and alive(int(p.name)):
            found.append(int(p.name))
    return found


def wait_for(
    predicate: Callable[[], bool],
    timeout: float,
    what: str,
    detail: Callable[[], str] = lambda: "",
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what} {detail()}"
        time.sleep(0.5)


def commands_of(pids: list[int]) -> str:
    """The command lines of ``pids``, for a failure's message."""
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            pass
    return "; ".join(out)


def scrape_while(
    proc: subprocess.Popen[str], ports: dict[str, int]
) -> dict[str, list[dict[str, Any]]]:
    """Scrapes ``/metrics`` of each process every 0.2 s until ``proc`` exits; each scrape
    parsed by Prometheus's own parser into ``{metric: {labels (except process): value}}``
    plus the ``process`` label."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[dict[str, Any]]] = {name: [] for name in ports}
    while proc.poll() is None:
        for name, port in ports.items():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                    text = r.read().decode()
            except OSError:
                continue  # not started yet, or gone
            scrape: dict[str, Any] = {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    labels = dict(sample.labels)
                    scrape["process"] = labels.pop("process")
                    key = tuple(sorted(labels.items()))
                    scrape.setdefault(sample.name, {})[key if key else ()] = sample.value
            out[name].append(scrape)
        time.sleep(0.2)
    return out


def test_a_short_run_trains_reports_and_leaves_nothing_running(
    bootstrap: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    base = free_port_pair(3)  # trainer and two producers
    proc = subprocess.Popen(
        [*run_args(bootstrap, run_dir), "--steps=3", "--producers=2", f"--metrics-port={base}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    # Prometheus metrics of each process, scraped while the run goes on
    scraped = scrape_while(proc, {"trainer": base, "producer-0": base + 1, "producer-1": base + 2})
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    out = last_json(stdout)
    figures = out["figures"]
    assert out["status"] == "completed"

    # every process started, and none is left
    children = json.loads((run_dir / "processes.json").read_text())
    assert [c["name"] for c in children] == ["trainer", "producer-0", "producer-1"]
    for c in children:
        assert c["returncode"] == 0, c
        assert not alive(c["pid"])
        assert Path(c["log"]).stat().st_size > 0
    assert processes_of(run_dir) == []

    # the figures agree with the trainer's metrics and the ledger
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert figures["steps"] == 3
    ledger = read_ledger(run_dir / "ledger.jsonl")
    trained = sum(len(e["trained"]) for e in ledger)
    assert figures["trajectories_trained"] == trained
    assert 0 < trained <= 3 * 8
    stale = sum(
        (d[3][1] - d[3][0] if isinstance(d[3], list) else 1)
        for e in ledger
        for d in e["dropped"]
        if d[4] in ("stale", "stale_range")
    )
    assert figures["trajectories_dropped_stale"] == stale
    for key in ("success_initial", "success_final", "steps", "wall_s"):
        assert figures[key] is not None
    assert 0.0 <= figures["success_initial"] <= 1.0
    evals = json.loads((run_dir / "eval.json").read_text())
    assert evals["initial"]["episodes"] == evals["final"]["episodes"] == 16
    assert evals["final"]["version"] == 3  # the last announced weights were evaluated
    produced = sum(
        json.loads((run_dir / "producers" / f"producer-{i}.jsonl").read_text().splitlines()[-1])[
            "episodes"
        ]
        for i in range(2)
    )
    assert figures["trajectories_produced"] == produced >= trained

    # the report states the same numbers in words, opens with its headline, and every
    # plot is a PNG with something drawn on it
    report = (run_dir / "report.md").read_text()
    assert f"| trajectories trained | {trained} |" in report
    assert "| trainer steps | 3 |" in report
    headline = report.split("## Figures")[0]
    assert "**Trained:**" in headline and "on `guess` for 3 steps" in headline
    assert "over random answers (41.4%)" in headline  # 1 - (7/8)^4, guess's default
    assert f"busy {figures['trainer_busy']:.0%} of its time" in headline
    assert figures["random_success"] == pytest.approx(1 - (7 / 8) ** 4)
    over = 100 * (figures["success_final"] - figures["random_success"])
    assert figures["gain_over_random_points"] == pytest.approx(over, abs=0.051)
    assert_plots(run_dir, report)
    # sample episodes, read back from the topic, as conversations
    shown = report.split("## Sample episodes")[1].split("## ")[0]
    assert shown.count("```text") == 4  # the best and worst of the first and last step
    assert "environment: Guess my number from 1 to 8." in shown and "\npolicy" in shown
    assert "(episode over: " in shown
    # what it ran on, as the trainer recorded it
    environment = json.loads((run_dir / "environment.json").read_text())
    assert environment["jax"]["backend"] == "cpu"
    assert f"JAX backend: cpu ({environment['jax']['devices']} device(s)" in report
    assert f"jax {environment['versions']['jax']}" in report
    config = json.loads((run_dir / "config.json").read_text())
    assert config["steps"] == 3 and config["producers"] == 2
    assert config["grpo"]["learning_rate"] == 1e-3 and config["sync"] is False
    assert config["model"]["d_model"] == 128  # every setting, the loss and the model included
    # each child ran the configuration the run wrote for it
    trainer_cfg = json.loads((run_dir / "configs" / "trainer.json").read_text())
    assert trainer_cfg["max_steps"] == 3 and trainer_cfg["grpo"] == config["grpo"]
    producer_cfg = json.loads((run_dir / "configs" / "producer-1.json").read_text())
    assert producer_cfg["producer_id"] == "producer-1"
    assert producer_cfg["admission"]["trainer_batch"] == 2 * 4  # the trainer's batch

    # every process's spans on one timeline; the profile's counts agree with the ledger
    profile = json.loads((run_dir / "profile.json").read_text())
    assert {"producer-0", "producer-1", "run"} <= set(profile["processes"])
    assert len(profile["processes"]) == 4  # and the trainer
    assert profile["trained"] == trained and profile["steps"] == 3
    ledger_drops: Counter[str] = Counter()
    for e in ledger:
        for d in e["dropped"]:
            ledger_drops[d[4]] += d[3][1] - d[3][0] if isinstance(d[3], list) else 1
    assert profile["dropped"] == dict(ledger_drops)
    assert 0 < profile["trainer_busy_share"] <= 1
    assert profile["kafka_latency_s"]["count"] > 0
    trace = json.loads((run_dir / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == set(profile["processes"])
    span_names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {
        "episode",
        "env_step",
        "policy_forward",
        "produce",
        "consume",
        "decode",
        "staleness_filter",
        "batch_assembly",
        "train_step",
        "checkpoint_save",
        "announce",
        "evaluate",
    } <= span_names
    assert "## Where the time went" in report

    # after the first step's metrics row (the step counter moves a moment before it)
    trainer_scrapes = [m for m in scraped["trainer"] if "rlstream_trainer_loss" in m]
    assert trainer_scrapes, "no scrape of the trainer after its first step"
    for m in trainer_scrapes:
        step = m["rlstream_trainer_step"][()]
        assert 8 * (step - 1) <= m["rlstream_trainer_trained_total"][()] <= trained
        assert m["rlstream_trainer_policy_version"][()] in (step - 1, step)
        assert m["rlstream_trainer_lag_records"][()] >= 0
        assert 0 < m["rlstream_trainer_busy_share"][()] <= 1
    for i in range(2):
        name = f"producer-{i}"
        assert scraped[name], f"no scrape of {name}"
        final = json.loads((run_dir / "producers" / f"{name}.jsonl").read_text().splitlines()[-1])
        last = scraped[name][-1]
        assert sum(last["rlstream_producer_episodes_total"].values()) <= final["episodes"]
        assert 0 <= last["rlstream_producer_policy_version"][()] <= 3
        assert last["process"] == name

    # TensorBoard scalars next to the JSONL metrics, read by TensorBoard's own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    losses = {e.step: e.value for e in acc.Scalars("train/loss")}
    steps = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert losses == pytest.approx({m["step"]: m["loss"] for m in steps}, rel=1e-6)
    assert [e.value for e in acc.Scalars("eval/success")] == pytest.approx(
        [evals["initial"]["success"], evals["final"]["success"]]
    )

    # rlstream report on what a trainer started on its own leaves: its trainer.json,
    # environment.json, metrics, ledger, checkpoints and weights, nothing of the run's
    alone = tmp_path / "alone"
    shutil.copytree(run_dir, alone)
    for name in ("config.json", "run.json", "eval.json", "figures.json", "report.md"):
        (alone / name).unlink()
    for name in ("plots", "producers", "configs"):
        shutil.rmtree(alone / name)
    assert json.loads((alone / "trainer.json").read_text())["max_steps"] == 3
    made = rlstream(
        "report", str(alone), "--eval-episodes", "8", "--bootstrap", bootstrap, "--json"
    )
    assert made.returncode == 0, made.stderr[-3000:]
    rebuilt = last_json(made.stdout)["figures"]
    assert rebuilt["steps"] == 3 and rebuilt["trajectories_trained"] == trained
    assert rebuilt["trajectories_produced"] is None  # no producer status was kept
    again = json.loads((alone / "eval.json").read_text())
    assert again["initial"]["episodes"] == again["final"]["episodes"] == 8
    assert again["final"]["version"] == 3
    text = (alone / "report.md").read_text()
    assert "a trainer started on its own" in text.split("## Figures")[0]
    assert_plots(alone, text)
    assert text.split("## Sample episodes")[1].count("```text") == 4  # read from the topic


def test_sync_mode_trains_each_batch_on_the_current_policy_only(
    bootstrap: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [*run_args(bootstrap, run_dir), "--steps=3", "--sync", "--eval-episodes=0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["staleness_hist"] == {"0": 8}  # a full batch, all of the trainer's version
        # so every policy token is compared with the sampler's, and they agree (float32)
        assert m["parity_tokens"] == m["tokens"] > 0
        assert m["logprob_diff_p99"] <= 1e-4 and m["mismatch_kl"] < 1e-6, m
    ledger = read_ledger(run_dir / "ledger.jsonl")
    assert sum(len(e["trained"]) for e in ledger) == 3 * 8
    # the producer generated exactly one batch per version, then waited
    status = json.loads((run_dir / "producers" / "producer-0.jsonl").read_text().splitlines()[-1])
    assert 3 * 8 <= status["episodes"] <= 4 * 8  # (the 4th may have started before the stop)
    assert status["in_flight"] == 0
    assert "| how the run ended | completed |" in (run_dir / "report.md").read_text()


def test_ctrl_c_mid_run_stops_every_process_and_still_reports(
    bootstrap: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    proc = start_long_run(bootstrap, run_dir)
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 300, "steps")
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    out = last_json(stdout)
    assert out["status"] == "interrupted"
    assert 2 <= out["figures"]["steps"] < 1000
    children = json.loads((run_dir / "processes.json").read_text())
    for c in children:
        assert c["returncode"] == 0, c  # stopped cleanly on SIGTERM, not killed
        assert not alive(c["pid"])
    assert processes_of(run_dir) == []
    report = (run_dir / "report.md").read_text()
    assert "| how the run ended | interrupted |" in report
    assert (run_dir / "plots" / "learning.png").exists()


def test_a_dead_child_stops_the_run_with_its_status_and_log(bootstrap: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_long_run(bootstrap, run_dir, "--eval-episodes=0")
    try:
        status = run_dir / "producers" / "producer-0.jsonl"
        wait_for(status.exists, 300, "the producer to run")
        children = json.loads((run_dir / "processes.json").read_text())
        producer = next(c for c in children if c["name"] == "producer-0")
        os.kill(producer["pid"], signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "producer-0" in stdout and "exited with status -9" in stdout
    assert "producer-0.log" in stdout  # where its log is; its last lines follow
    out = last_json(stdout)
    assert out["status"] == "failed"
    assert processes_of(run_dir) == []
    assert "| how the run ended | failed |" in (run_dir / "report.md").read_text()


def test_bad_run_settings_fail_before_anything_starts(tmp_path: Path) -> None:
    for flags, message in (
        (["--env=nosuch"], "unknown environment 'nosuch'"),
        (["--sync", "--producers=3"], "does not split into whole groups"),
    ):
        proc = subprocess.run(
            [*run_args("127.0.0.1:1", tmp_path / "run"), *flags],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert proc.returncode == 2
        assert message in proc.stderr
        assert not (tmp_path / "run").exists()


def test_children_stop_when_the_run_itself_is_killed(bootstrap: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_long_run(bootstrap, run_dir, "--eval-episodes=0")
    try:
        wait_for((run_dir / "producers" / "producer-0.jsonl").exists, 300, "the producer")
        assert len(processes_of(run_dir)) >= 3  # run, trainer, producer
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    wait_for(
        lambda: processes_of(run_dir) == [],
        90,
        "the children to stop",
        lambda: commands_of(processes_of(run_dir)),
    )
    # its status said how long the episodes in flight had run
    rows = []
    for line in (run_dir / "producers" / "producer-0.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # (the line being written when it was stopped)
            pass
    busy = [r["in_flight_age_s"] for r in rows if r["in_flight"] > 0]
    assert busy and all(0 <= a["p50"] <= a["max"] for a in busy), busy
    assert any(a["max"] > 0 for a in busy), busy


def test_a_killed_run_leaves_not_even_its_own_broker(tmp_path: Path) -> None:
    """A run without ``--bootstrap`` starts a local broker for itself; SIGKILLed, it left
    that broker running (reparented to init): now the broker's nodes get SIGTERM with
    the trainer and the producers."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "RLSTREAM_BOOTSTRAP"}
    proc = subprocess.Popen(
        [
            *run_command("", run_dir, *SHORT, "--steps=1000", "--eval-episodes=0"),
            f"--data-dir={tmp_path / 'broker'}",
            f"--port={free_port_pair(2)}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env=env,
    )
    try:
        wait_for((run_dir / "producers" / "producer-0.jsonl").exists, 300, "the producer")
        assert len(processes_of(tmp_path)) >= 4  # run, broker, trainer, producer
    finally:
        proc.kill()
        proc.wait(30)
    wait_for(
        lambda: processes_of(tmp_path) == [],
        90,
        "the broker and the children to stop",
        lambda: commands_of(processes_of(tmp_path)),
    )


def test_the_tool_arithmetic_recipe_runs_every_stage(bootstrap: str, tmp_path: Path) -> None:
    """recipes/tool-arithmetic.sh at toy sizes: one run whose warm start makes
    demonstrations, a Qwen3-family checkpoint with its tokenizer trained on them and SFT,
    then RL through Kafka from the SFT model, its start and final policy evaluated."""
    out = tmp_path / "ta"
    env = {
        **os.environ,
        "OUT": str(out),
        "DEMOS": "24",
        "DRILLS": "16",
        "PRESET": "tiny",
        "EPOCHS": "1",
        "RLSTREAM": str(Path(sys.executable).parent / "rlstream"),
    }
    flags = [f"--bootstrap={bootstrap}", "--steps=2", "--eval-episodes=4", "--json"]
    flags += ["--groups-per-batch=1", "--group-size=4", "--concurrency=8"]
    proc = subprocess.run(
        ["bash", "recipes/tool-arithmetic.sh", *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    warm = out / "warm_start"
    demos = [json.loads(ln) for ln in (warm / "demos.jsonl").read_text().splitlines()]
    assert len(demos) == 24
    # the recipe's demonstrations answer half the tasks without the tool (mental_share),
    # the wrong ones kept
    assert 0 < sum(len(d["messages"]) == 2 for d in demos) < 24
    assert len((warm / "pretrain-echo.jsonl").read_text().splitlines()) == 16
    assert len((warm / "tokenizer-text.jsonl").read_text().splitlines()) == 40
    sft = json.loads((warm / "sft.json").read_text())
    assert sft["model"]["path"] == str(warm / "pretrain" / "model")  # after the drills
    assert (warm / "sft" / "loss.png").is_file()
    assert (warm / "sft" / "model" / "config.json").is_file()
    for stage in ("demos", "demos-pretrain-echo", "init", "pretrain", "sft"):
        assert (out / "logs" / f"warm-start-{stage}.log").is_file()
    figures = last_json(proc.stdout)["figures"]
    assert figures["steps"] == 2
    assert figures["warm_start"]["demos_written"] == 24 and figures["warm_start"]["sft_steps"] >= 1
    assert figures["warm_start"]["pretrain_conversations"] == 16
    for which in ("initial", "final"):
        assert 0 <= figures[f"tool_call_rate_{which}"] <= 1
        assert 0 <= figures[f"tool_error_rate_{which}"] <= 1
        for split in ("with", "without"):  # None: no held-out episode of that kind
            value = figures[f"success_{split}_tool_{which}"]
            assert value is None or 0 <= value <= 1
    metrics = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and "calc" in metrics[0]["success"]
    assert all(0 <= m["tool_call_rate"]["calc"] <= 1 for m in metrics)
    assert all(0 <= m["tool_error_rate"]["calc"] <= 1 for m in metrics)
    trainer = json.loads((out / "configs" / "trainer.json").read_text())
    assert trainer["model"]["path"] == str(warm / "sft" / "model")
    # every record the Qwen3-format producer wrote was checked: its context pieces are the
    # conversation rendered at once (policy turns the template rewrites are counted apart)
    status = json.loads((out / "producers" / "producer-0.jsonl").read_text().splitlines()[-1])
    assert status["exactness_checked"] >= 1 and status["divergent_context"] == 0, status
    # the run's own configuration keeps the warm start, so it runs again as it was
    assert json.loads((out / "config.json").read_text())["warm_start"]["demos"] == 24
    assert "warm start" in (out / "report.md").read_text()


def test_bench_learn_runs_a_warm_started_configuration_per_seed(
    bootstrap: str, tmp_path: Path
) -> None:
    """``bench learn --config FILE``: each seed makes its own warm start (demonstrations
    and echo drills, checkpoint, SFT on the drills then on the demonstrations) then RL;
    the figures are the gain over each seed's SFT start, its SFT loss and the tool-call
    rates, and the gate is the recipe's."""
    config = tmp_path / "toy.yaml"
    config.write_text(
        "env: calc\n"
        "env_options: {max_operand: 999}\n"
        "warm_start: {demos: 16, preset: tiny, pretrain: {echo: 8},"
        " pretrain_sft: {epochs: 1, rows: 2, length: 256},"
        " sft: {epochs: 1, rows: 2, length: 1024}}\n"
        "max_new_tokens: 48\nsteps: 2\ngroup_size: 4\ngroups_per_batch: 1\n"
        "concurrency: 8\neval_episodes: 4\n"
    )
    out = tmp_path / "bench"
    args = ["bench", "learn", f"--config={config}", "--seeds=2", "--first-seed=3"]
    args += [f"--run-dir={out}", f"--bootstrap={bootstrap}", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = last_json(proc.stdout)
    figures = result["figures"]
    assert result["goals"] == {"gain_over_start_min_points": ">= 20", "wall_max_s": "<= 1200"}
    assert figures["gain_over_start_min_points"] == min(figures["gain_points"])
    assert len(figures["sft_loss_final"]) == 2 and all(x > 0 for x in figures["sft_loss_final"])
    assert len(figures["success_start"]) == len(figures["tool_call_rate_final"]) == 2
    assert 0 <= figures["tool_call_rate_up_seeds"] <= 2
    for seed in (3, 4):
        warm = out / f"seed{seed}" / "warm_start"
        assert len((warm / "tokenizer-text.jsonl").read_text().splitlines()) == 24
        assert (warm / "pretrain" / "model" / "config.json").is_file()
        assert json.loads((warm / "sft.json").read_text())["seed"] == seed
