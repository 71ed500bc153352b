"""A run directory's report, plots and held-out evaluation, whoever started the run.

``rlstream run`` calls :func:`build_report` when it ends; ``rlstream report RUN_DIR`` calls
it for any run directory: one ``rlstream run`` wrote (``config.json``), or one a trainer
started on its own wrote (``trainer.json``; producers started with ``--status-file`` under
its ``producers/`` add their lines). What the directory does not hold is measured now
(the held-out evaluation) or read from Kafka (sample episodes, the profile); what cannot
be had is said so in the report.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from connectors.base import make
from pipeline.errors import InvalidConfigError, RlstreamError
from pipeline.kafka.client import KafkaConfig
from pipeline.observe import episodes, provenance
from pipeline.observe.plots import Limits, render
from pipeline.observe.report import (
    Report,
    algorithm_text,
    busy_share,
    ledger_summary,
    mean_over_envs,
    model_text,
    producer_status,
    trainer_metrics,
    write_report,
)
from pipeline.policy.config import ModelConfig, SamplingConfig
from pipeline.policy.tokenizer import tokenizer_for
from pipeline.records.ledger import run_ledger
from pipeline.rollout.config import EpisodeLimits
from pipeline.rollout.evaluate import evaluate_weights, latest_weights
from pipeline.settings import resolve, to_mapping

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Subject:
    """What a run directory says was trained, and how to evaluate it."""

    env: str
    env_options: Mapping[str, Any]
    model: ModelConfig
    #: MCP servers of the episodes' tools
    tools: tuple[str, ...]
    seed: int
    max_new_tokens: int
    temperature: float
    eval_episodes: int
    namespace: str | None
    max_staleness: int
    #: trajectories not yet trained plus episodes in flight that producers allow
    admission_budget: int
    #: how the processes ran, in words
    setup: str
    config: dict[str, Any]


def subject(
    run_dir: Path,
    env: str | None = None,
    env_options: Mapping[str, Any] | None = None,
    eval_episodes: int | None = None,
) -> Subject:
    """Read from ``config.json`` (``rlstream run``) or ``trainer.json`` (a trainer);
    ``env``, ``env_options`` and ``eval_episodes`` override what the directory says."""
    from pipeline.launch.config import RunConfig
    from pipeline.launch.warm_start import model_dir
    from pipeline.train.config import TrainerConfig

    if not run_dir.is_dir():
        raise InvalidConfigError(f"{run_dir} is not a directory: give a run directory")
    info = run_info(run_dir)
    if (run_dir / "config.json").exists():
        cfg = resolve(RunConfig, {}, file=run_dir / "config.json")
        config = to_mapping(cfg)
        if cfg.warm_start.enabled and (model_dir(run_dir) / "config.json").is_file():
            cfg = cfg.started_from(ModelConfig.from_name(str(model_dir(run_dir))))
            config["model"] = to_mapping(cfg.model)
        batch = cfg.groups_per_batch * cfg.group_size
        mode = "synchronous" if cfg.sync else "asynchronous"
        return Subject(
            env=env or cfg.env,
            env_options=dict(cfg.env_options if env_options is None else env_options),
            model=cfg.model,
            tools=cfg.tools,
            seed=cfg.seed,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature if cfg.eval_temperature is None else cfg.eval_temperature,
            eval_episodes=cfg.eval_episodes if eval_episodes is None else eval_episodes,
            namespace=info.get("namespace"),
            max_staleness=cfg.max_staleness,
            admission_budget=max(1, cfg.max_staleness) * batch,
            setup=f"{mode}, {cfg.producers} producer(s) of {cfg.concurrency} episodes, "
            f"{cfg.trainers} trainer process(es), max_staleness {cfg.max_staleness}",
            config=config,
        )
    if (run_dir / "trainer.json").exists():
        tcfg = resolve(TrainerConfig, {}, file=run_dir / "trainer.json")
        trained_envs = sorted({e for m in trainer_metrics(run_dir) for e in m.get("reward", {})})
        if env is None and not trained_envs:
            raise InvalidConfigError(
                f"{run_dir} has no trained step that names its environment: give --env"
            )
        return Subject(
            env=env or trained_envs[0],
            env_options=dict(env_options or {}),
            model=tcfg.model,
            tools=(),
            seed=tcfg.seed,
            max_new_tokens=EpisodeLimits.max_new_tokens,
            temperature=SamplingConfig.temperature,
            eval_episodes=200 if eval_episodes is None else eval_episodes,
            namespace=tcfg.namespace,
            max_staleness=tcfg.max_staleness,
            admission_budget=max(1, tcfg.max_staleness) * tcfg.groups_per_batch * tcfg.group_size,
            setup=f"a trainer started on its own (namespace {tcfg.namespace}, "
            f"{tcfg.members} process(es)), max_staleness {tcfg.max_staleness}",
            config=to_mapping(tcfg),
        )
    raise InvalidConfigError(
        f"{run_dir} holds neither config.json (written by rlstream run) nor trainer.json "
        "(written by rlstream train): give the directory a run or a trainer wrote"
    )


def evaluate(run_dir: Path, s: Subject, which: str, say: Callable[[str], None]) -> dict[str, Any]:
    """Held-out success of the initial policy or of the newest weights in ``run_dir``."""
    found = latest_weights(run_dir) if which == "final" else None
    version, weights = found if found is not None else (0, None)
    say(
        f"evaluating the {which} policy (version {version}) on {s.eval_episodes} "
        "held-out episodes ..."
    )
    result = evaluate_weights(
        s.env,
        env_options=dict(s.env_options),  # held-out episodes without simulated latency
        tools=s.tools,
        model=s.model,
        weights=weights,
        version=version,
        model_seed=s.seed,
        episodes=s.eval_episodes,
        seed=s.seed,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
    )
    say(
        f"  {which}: success {result.success:.3f} reward {result.reward_mean:.3f} "
        f"({result.seconds:.1f}s)"
    )
    return result.to_json()


def evaluations(
    run_dir: Path, s: Subject, say: Callable[[str], None]
) -> dict[str, dict[str, Any] | None]:
    """``eval.json`` if the run evaluated both policies, otherwise evaluated now (and
    written there); none when ``eval_episodes`` is 0."""
    found = _json(run_dir / "eval.json") or {}
    if found.get("initial") and found.get("final"):
        return {"initial": found["initial"], "final": found["final"]}
    if s.eval_episodes == 0:
        return {"initial": None, "final": None}
    evals = {w: found.get(w) or evaluate(run_dir, s, w, say) for w in ("initial", "final")}
    (run_dir / "eval.json").write_text(json.dumps(evals, indent=2))
    return evals


#: the evaluations' figures of tool use, reported for the start and the final policy
TOOL_FIGURES = ("tool_call_rate", "tool_error_rate", "success_with_tool", "success_without_tool")


def figures(
    run_dir: Path, s: Subject, evals: Mapping[str, dict[str, Any] | None]
) -> dict[str, Any]:
    """The run's figures, from its files."""
    metrics = trainer_metrics(run_dir)
    ledger = ledger_summary(run_dir)
    info = run_info(run_dir)
    produced, aborted, versions = 0, 0, {}
    for name, rows in producer_status(run_dir).items():
        if rows:
            produced += rows[-1].get("episodes", 0)
            aborted += rows[-1].get("aborted_stale", 0)
            versions[name] = rows[-1].get("version", 0)
    processes = _json(run_dir / "processes.json") or []
    init, final = evals.get("initial"), evals.get("final")
    stale = [m["staleness_mean"] for m in metrics]
    wall = info.get("wall_s")
    if wall is None and metrics:  # a trainer alone: from its start to its last step
        first = metrics[0]
        wall = round(
            metrics[-1]["time"] - first["time"] + first.get("busy_s", 0) + first.get("idle_s", 0), 1
        )
    try:
        random_success = make(s.env, **s.env_options).random_success()
    except Exception:  # an environment that cannot be built here: no baseline
        random_success = None
    return {
        "status": info.get("status", "completed" if metrics else "no step trained"),
        "success_initial": init["success"] if init else None,
        "success_final": final["success"] if final else None,
        "success_gain_points": (
            round(100 * (final["success"] - init["success"]), 1) if init and final else None
        ),
        "random_success": random_success,
        # what is learned beyond answers in the right format: the final policy's success
        # above the random-answer baseline (negative: below it)
        "gain_over_random_points": (
            round(100 * (final["success"] - random_success), 1)
            if final and random_success is not None
            else None
        ),
        "eval_episodes": s.eval_episodes,
        # held-out episodes with a tool call, tool calls that came back as errors, and
        # success split by tool use (the start's no-tool answers are a baseline)
        **{
            f"{name}_{which}": ev.get(name) if ev else None
            for name in TOOL_FIGURES
            for which, ev in (("initial", init), ("final", final))
        },
        # demonstrations, SFT steps, final SFT loss and seconds of the warm start
        "warm_start": _json(run_dir / "warm_start" / "summary.json"),
        "steps": metrics[-1]["step"] if metrics else 0,
        "wall_s": wall,
        "pipeline_wall_s": info.get("pipeline_wall_s"),
        "trajectories_produced": produced if versions else None,
        "trajectories_trained": ledger["trained"],
        "trajectories_dropped_stale": ledger["dropped_stale"],
        "episodes_aborted_stale": aborted if versions else None,
        "dropped": ledger["dropped"],
        "staleness_mean": round(sum(stale) / len(stale), 3) if stale else None,
        "trainer_busy": round(busy_share(metrics, first=1), 3) if metrics else None,
        "final_batch_reward": round(mean_over_envs(metrics[-1]["reward"]), 3) if metrics else None,
        "producer_versions": versions,
        "restarts": {p["name"]: p["restarts"] for p in processes if p.get("restarts")},
    }


def build_report(
    run_dir: Path,
    kafka: KafkaConfig | None,
    *,
    env: str | None = None,
    env_options: Mapping[str, Any] | None = None,
    eval_episodes: int | None = None,
    say: Callable[[str], None] = print,
    no_kafka: str = "no Kafka cluster was given",
) -> tuple[dict[str, Any], Path]:
    """Evaluate what is not evaluated yet, then write ``figures.json``, ``report.md``
    and ``plots/``; returns the figures and the report's path. Without ``kafka`` the
    episodes and the profile are left out, the report saying why (``no_kafka``)."""
    s = subject(run_dir, env, env_options, eval_episodes)
    evals = evaluations(run_dir, s, say)
    figs = figures(run_dir, s, evals)
    metrics = trainer_metrics(run_dir)
    info = run_info(run_dir)
    start = info.get("start_time") or started(metrics, producer_status(run_dir))
    limits = Limits(
        start_time=start,
        max_staleness=s.max_staleness,
        admission_budget=s.admission_budget,
        evals=tuple((e["version"], e["success"]) for e in evals.values() if e),
        random_success=figs["random_success"],
    )
    plots = render(run_dir, limits)
    profile_text, shown = "", [f"Not read: {no_kafka}."]
    if kafka is not None and s.namespace:
        profile_text = profile(run_dir, kafka, s.namespace)
        shown = sample_episodes(run_dir, kafka, s.model)
    what = (
        f"{model_text(s.config.get('model'))} on `{s.env}` for {figs['steps']} steps "
        f"({figs['trajectories_trained']} trajectories) with "
        f"{algorithm_text(s.config.get('grpo'), s.config.get('lora'))}; {s.setup}."
    )
    warm = figs.get("warm_start")
    if isinstance(warm, dict) and isinstance(warm.get("sft_loss_final"), float):
        what += (
            f" Its warm start: {warm.get('demos_written')} demonstrations of the "
            f"environment's scripted solver, SFT for {warm.get('sft_steps')} steps to loss "
            f"{warm['sft_loss_final']:.3f} ({warm.get('seconds')} s); the initial policy "
            "is the SFT model."
        )
    report = Report(
        title=run_dir.name,
        what=what,
        figures=figs,
        config=s.config,
        plots=plots,
        environment=provenance.read(run_dir),
        profile=profile_text,
        episodes=shown,
    )
    path = write_report(run_dir, report)
    (run_dir / "figures.json").write_text(json.dumps(figs, indent=2, sort_keys=True))
    return figs, path


def started(metrics: list[dict[str, Any]], producers: dict[str, list[dict[str, Any]]]) -> float:
    """When the processes of a run that did not record its start began: the first
    producer status line, or the trainer's first step less the time it took."""
    times = [rows[0]["time"] for rows in producers.values() if rows]
    if metrics:
        first = metrics[0]
        times.append(first["time"] - first.get("busy_s", 0.0) - first.get("idle_s", 0.0))
    return min(times, default=time.time())


def profile(run_dir: Path, kafka: KafkaConfig, namespace: str) -> str:
    """Every process's spans on one timeline (``trace.json``) and the profile summary
    (``profile.json``); the summary's text for the report ("" if there is none)."""
    from pipeline.observe import profile as prof

    try:
        telemetry = prof.read(kafka, namespace)
    except Exception as e:  # the report is written whatever happened to telemetry
        log.warning("no profile: %s", e)
        return ""
    summary = prof.summarize(telemetry)
    prof.write_trace(telemetry, run_dir / "trace.json")
    (run_dir / "profile.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return prof.render(summary, busy=False)


def sample_episodes(run_dir: Path, kafka: KafkaConfig, model: ModelConfig) -> list[str]:
    """The best and the worst episode of the first and the last step, as markdown."""
    entries = run_ledger(run_dir)
    steps = sorted({e["step"] for e in entries if e["trained"]})
    if not steps:
        return ["No step trained, so no episode to show."]
    try:
        shown = episodes.samples(kafka, entries, steps[0], steps[-1])
        tokenizer = tokenizer_for(model.path)
    except (RlstreamError, OSError) as e:
        return [f"Not read: {e}"]
    if not shown:
        return ["The rollout topic no longer holds the trained records (retention)."]
    return episodes.render(shown, tokenizer)


def run_info(run_dir: Path) -> dict[str, Any]:
    """``run.json`` (what ``rlstream run`` recorded: namespace, cluster, times, status),
    empty for a directory without one."""
    info = _json(run_dir / "run.json")
    return info if isinstance(info, dict) else {}


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
