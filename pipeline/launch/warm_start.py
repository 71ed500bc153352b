"""A run's warm start (``warm_start.demos > 0``): demonstrations of the environment's
scripted solver, a random checkpoint of a model family with a tokenizer trained on them,
optionally a first SFT stage on other environments' demonstrations (``warm_start.pretrain``:
what pretraining teaches a real model, such as copying text, which a random one lacks),
then SFT on the demonstrations; the run's RL starts from what SFT wrote.

Each stage is a child process of the command a user would run by hand (``rlstream env
demos``, ``rlstream model init``, ``rlstream sft``), its log in ``logs/``, its output in
``warm_start/`` of the run directory. A stage whose output is complete is not run again
(a run continued in the same directory), a partial one is started over.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from connectors.base import Environment, make
from pipeline.errors import InvalidConfigError, RlstreamError
from pipeline.launch.supervisor import Child, Supervisor
from pipeline.policy.config import ModelConfig
from pipeline.policy.hf_init import SHAPES
from pipeline.settings import from_mapping, write_file
from pipeline.train.config import SFTConfig

#: the families ``rlstream model init`` writes
FAMILIES = ("llama", "qwen2", "qwen3")
#: settings of the SFT stages the warm start sets itself
_OWN = ("data", "out", "model", "seed")


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """Demonstrations, a new checkpoint and SFT before the run's RL."""

    #: demonstrations of the environment's scripted solver (0: no warm start, the run
    #: starts from its model)
    demos: int = 0
    #: the family of the checkpoint it makes (llama, qwen2, qwen3)
    family: str = "qwen3"
    #: its sizes (tiny, small, 0.5b-shape: rlstream model init --preset)
    preset: str = "small"
    #: its tokenizer's vocabulary at most (None: rlstream model init's default)
    vocab_size: int | None = None
    #: write the demonstrations the environment does not reward as solved too (a solver
    #: that is wrong on purpose some of the time, as calc's ``mental_share`` is)
    keep_unsolved: bool = False
    #: demonstrations of other environments, by name, fine-tuned on first in a stage of
    #: their own (e.g. ``echo: 3000``: copy drills, what pretraining teaches a real model
    #: and a random one lacks)
    pretrain: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: settings of rlstream sft for that first stage
    pretrain_sft: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: settings of rlstream sft by name (epochs, rows, length, learning_rate ...); its
    #: data, out, model and seed are the warm start's
    sft: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.demos, bool) or self.demos < 0:
            raise InvalidConfigError(f"warm_start.demos must be 0 or more, not {self.demos}")
        if self.family not in FAMILIES:
            raise InvalidConfigError(
                f"warm_start.family {self.family!r} is not one of {', '.join(FAMILIES)}"
            )
        if self.preset not in SHAPES:
            raise InvalidConfigError(
                f"warm_start.preset {self.preset!r} is not one of {', '.join(SHAPES)}"
            )
        for name, count in self.pretrain.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise InvalidConfigError(
                    f"warm_start.pretrain: {name!r} needs a count of demonstrations >= 1, "
                    f"not {count!r}"
                )
            check_solver(make(name), name, "warm_start.pretrain")
        for where, given in (("sft", self.sft), ("pretrain_sft", self.pretrain_sft)):
            own = sorted(set(given) & set(_OWN))
            if own:
                raise InvalidConfigError(
                    f"warm_start.{where}: {', '.join(own)} are the warm start's own (the "
                    "demonstrations, the run directory, the checkpoint, the run's seed)"
                )
            from_mapping(SFTConfig, dict(given), f"warm_start.{where}")  # refused now

    @property
    def enabled(self) -> bool:
        return self.demos > 0


def check_solver(env: Environment, name: str, where: str) -> None:
    """InvalidConfigError unless environment ``name`` has a scripted solver to make
    demonstrations with (:meth:`Environment.demonstrate`)."""
    if type(env).demonstrate is Environment.demonstrate:
        raise InvalidConfigError(
            f"{where}: environment {name!r} has no scripted solver "
            "(Environment.demonstrate) to demonstrate with"
        )


def model_dir(run_dir: Path) -> Path:
    """Where the warm start of the run in ``run_dir`` writes the checkpoint RL starts from."""
    return run_dir / "warm_start" / "sft" / "model"


def prepare(
    ws: WarmStartConfig,
    env: str,
    env_options: Mapping[str, Any],
    seed: int,
    run_dir: Path,
    say: Callable[[str], None],
    stop: threading.Event,
    child_env: Mapping[str, str] | None = None,
) -> ModelConfig:
    """Run the stages not done yet; the model SFT wrote. RlstreamError when a stage fails
    (with its log's tail) or ``stop`` is set."""
    root = run_dir / "warm_start"
    demos = root / "demos.jsonl"
    drills = root / "pretrain-data.jsonl"  # the pretraining stage's demonstrations
    text = root / "tokenizer-text.jsonl"  # all of them: what the tokenizer is trained on
    init = root / "init"
    t0 = time.monotonic()
    summary: dict[str, Any] = {"demos": ws.demos, "pretrain": dict(ws.pretrain)}

    def stage(name: str, args: list[str]) -> None:
        _stage(name, args, run_dir, say, stop, child_env)

    sources = [(env, env_options, ws.demos, demos)]
    sources += [
        (name, {}, n, root / f"pretrain-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.jsonl")
        for name, n in ws.pretrain.items()
    ]
    for name, options, n, path in sources:
        if not path.is_file():
            flags = [f"--env-option={k}={json.dumps(v)}" for k, v in options.items()]
            if path == demos and ws.keep_unsolved:
                flags.append("--keep-unsolved")
            stage(
                "demos" if path == demos else f"demos-{path.stem}",
                ["env", "demos", name, *flags, f"--episodes={n}", f"--seed={seed}",
                 f"--output={path}"],
            )  # fmt: skip
    summary["demos_written"] = _lines(demos)
    _concatenate([p for *_, p in sources[1:]], drills)
    _concatenate([p for *_, p in sources], text)
    if not (init / "config.json").is_file():
        shutil.rmtree(init, ignore_errors=True)
        vocab = [] if ws.vocab_size is None else [f"--vocab-size={ws.vocab_size}"]
        stage(
            "init",
            ["model", "init", f"--family={ws.family}", f"--preset={ws.preset}",
             f"--seed={seed}", f"--tokenizer-text={text}", *vocab, f"--output={init}"],
        )  # fmt: skip
    start = init
    if ws.pretrain:
        summary["pretrain_conversations"] = _lines(drills)
        summary["pretrain_loss_final"] = _sft(
            "pretrain", ws.pretrain_sft, drills, init, root / "pretrain", seed, stage
        )
        start = root / "pretrain" / "model"
    summary["sft_loss_final"] = _sft("sft", ws.sft, demos, start, root / "sft", seed, stage)
    summary["sft_steps"] = _lines(root / "sft" / "metrics.jsonl")
    summary["seconds"] = round(time.monotonic() - t0, 1)
    (root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    loss = summary["sft_loss_final"]
    say(
        f"warm start: {summary['demos_written']} demonstrations"
        + (f" after {summary['pretrain_conversations']} of pretraining" if ws.pretrain else "")
        + f", SFT {summary['sft_steps']} steps"
        + (f" to loss {loss:.3f}" if loss is not None else "")
        + f", in {summary['seconds']:.0f} s"
    )
    return ModelConfig.from_name(str(model_dir(run_dir)))


def _sft(
    name: str,
    settings: Mapping[str, Any],
    data: Path,
    model: Path,
    out: Path,
    seed: int,
    stage: Callable[[str, list[str]], None],
) -> float | None:
    """SFT stage ``name`` of ``model`` on ``data`` into ``out`` (unless done); its last
    loss."""
    if not (out / "model" / "config.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        given = {**settings, "data": str(data), "out": str(out), "model": str(model), "seed": seed}
        path = write_file(
            from_mapping(SFTConfig, given, f"warm_start.{name}"), out.with_suffix(".json")
        )
        stage(name, ["sft", f"--config={path}"])
    last = None
    with (out / "metrics.jsonl").open() as f:
        for line in f:
            last = json.loads(line).get("loss")
    return last


def _concatenate(parts: list[Path], out: Path) -> None:
    """``out``: the files ``parts`` one after the other (unless it is there)."""
    if out.is_file() or not parts:
        return
    tmp = out.with_name(out.name + ".partial")
    with tmp.open("wb") as f:
        for path in parts:
            f.write(path.read_bytes())
    tmp.replace(out)


def _lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def _stage(
    name: str,
    args: list[str],
    run_dir: Path,
    say: Callable[[str], None],
    stop: threading.Event,
    child_env: Mapping[str, str] | None,
) -> None:
    child = Child(f"warm-start-{name}", args, run_dir / "logs" / f"warm-start-{name}.log",
                  dict(child_env or {}))  # fmt: skip
    say(f"warm start: {name} (log {child.log_path})")
    supervisor = Supervisor([child])
    supervisor.start()
    try:
        while child.running():
            if stop.wait(0.5):
                raise RlstreamError(f"stopped during the warm start's {name} stage")
    finally:
        supervisor.stop(grace_s=10.0)
    if child.returncode != 0:
        raise RlstreamError(
            f"the warm start's {name} stage failed (exit {child.returncode}):\n{child.log_tail()}"
        )
