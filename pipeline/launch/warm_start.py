"""A run's warm start (``warm_start.demos > 0``): demonstrations of the environment's
scripted solver (with those of other environments mixed in, ``warm_start.mix``), a random
checkpoint of a model family with a tokenizer trained on them, and SFT on them; the run's
RL starts from what SFT wrote.

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
#: settings of the SFT stage the warm start sets itself
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
    #: demonstrations of other environments mixed into the SFT data, by name (e.g.
    #: ``echo: 1000``: copy drills, what pretraining teaches a real model and a random one
    #: lacks)
    mix: Mapping[str, int] = dataclasses.field(default_factory=dict)
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
        for name, count in self.mix.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise InvalidConfigError(
                    f"warm_start.mix: {name!r} needs a count of demonstrations >= 1, not {count!r}"
                )
            if type(make(name)).demonstrate is Environment.demonstrate:
                raise InvalidConfigError(
                    f"warm_start.mix: environment {name!r} has no scripted solver"
                )
        own = sorted(set(self.sft) & set(_OWN))
        if own:
            raise InvalidConfigError(
                f"warm_start.sft: {', '.join(own)} are the warm start's own (the "
                "demonstrations, the run directory, the new checkpoint, the run's seed)"
            )
        from_mapping(SFTConfig, dict(self.sft), "warm_start.sft")  # refused now, not later

    @property
    def enabled(self) -> bool:
        return self.demos > 0


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
    data = root / "sft-data.jsonl"  # the demonstrations and those mixed in
    init = root / "init"
    out = root / "sft"
    t0 = time.monotonic()
    summary: dict[str, Any] = {"demos": ws.demos, "mix": dict(ws.mix)}
    sources = [(env, env_options, ws.demos, demos)]
    sources += [
        (name, {}, n, root / f"mix-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.jsonl")
        for name, n in ws.mix.items()
    ]
    for i, (name, options, n, path) in enumerate(sources):
        if not path.is_file():
            flags = [f"--env-option={k}={json.dumps(v)}" for k, v in options.items()]
            _stage(
                "demos" if i == 0 else f"demos-{path.stem}",
                ["env", "demos", name, *flags, f"--episodes={n}", f"--seed={seed}",
                 f"--output={path}"],
                run_dir, say, stop, child_env,
            )  # fmt: skip
    summary["demos_written"] = _lines(demos)
    if not data.is_file():
        tmp = data.with_name(data.name + ".partial")
        with tmp.open("wb") as f:
            for *_, path in sources:
                f.write(path.read_bytes())
        tmp.replace(data)
    summary["sft_conversations"] = _lines(data)
    if not (init / "config.json").is_file():
        shutil.rmtree(init, ignore_errors=True)
        vocab = [] if ws.vocab_size is None else [f"--vocab-size={ws.vocab_size}"]
        _stage(
            "init",
            ["model", "init", f"--family={ws.family}", f"--preset={ws.preset}",
             f"--seed={seed}", f"--tokenizer-text={data}", *vocab, f"--output={init}"],
            run_dir, say, stop, child_env,
        )  # fmt: skip
    if not (model_dir(run_dir) / "config.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        given = {**ws.sft, "data": str(data), "out": str(out), "model": str(init), "seed": seed}
        sft = from_mapping(SFTConfig, given, "warm_start.sft")
        path = write_file(sft, root / "sft.json")
        _stage("sft", ["sft", f"--config={path}"], run_dir, say, stop, child_env)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").open()]
    summary |= {"sft_steps": len(losses), "sft_loss_final": losses[-1] if losses else None}
    summary["seconds"] = round(time.monotonic() - t0, 1)
    (root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    mixed = summary["sft_conversations"] - summary["demos_written"]
    say(
        f"warm start: {summary['demos_written']} demonstrations"
        + (f" and {mixed} mixed in" if mixed else "")
        + f", SFT {len(losses)} steps"
        + (f" to loss {losses[-1]:.3f}" if losses else "")
        + f", in {summary['seconds']:.0f} s"
    )
    return ModelConfig.from_name(str(model_dir(run_dir)))


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
