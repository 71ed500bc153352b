"""One source of configuration: defaults written once, flags and files derived from the
config classes, every shared setting the same in run, produce and train."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from connectors.serve import ServeConfig
from pipeline.cli.main import build_parser
from pipeline.errors import InvalidConfigError
from pipeline.launch.config import RunConfig
from pipeline.rollout.config import EvalConfig, ProducerConfig
from pipeline.settings import (
    add_flags,
    field_docs,
    leaf_paths,
    resolve,
    to_mapping,
    write_file,
)
from pipeline.train.config import TrainerConfig

CONFIGS = (ProducerConfig, TrainerConfig, RunConfig, EvalConfig, ServeConfig)


def default(cls: type) -> dict[str, Any]:
    return to_mapping(resolve(cls, {}, environ={}))


def at(data: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        data = data[part]
    return data


#: a setting of the run -> where the same setting lives in the other processes
SHARED = {
    "env": {ProducerConfig: "env", EvalConfig: "env"},
    "env_options": {ProducerConfig: "env_options", EvalConfig: "env_options"},
    "concurrency": {ProducerConfig: "concurrency"},
    "group_size": {ProducerConfig: "group_size", TrainerConfig: "group_size"},
    "groups_per_batch": {TrainerConfig: "groups_per_batch"},
    "max_new_tokens": {ProducerConfig: "limits.max_new_tokens", EvalConfig: "max_new_tokens"},
    "max_staleness": {ProducerConfig: "admission.max_staleness", TrainerConfig: "max_staleness"},
    "temperature": {
        ProducerConfig: "sampling.temperature",
        EvalConfig: "temperature",
        TrainerConfig: "grpo.temperature",
    },
    "latency_ms": {ProducerConfig: "latency_ms"},
    "latency_sigma": {ProducerConfig: "latency_sigma"},
    "partitions": {ProducerConfig: "partitions"},
    "seed": {TrainerConfig: "seed", ProducerConfig: "model_seed", EvalConfig: "model_seed"},
    "metrics_host": {ProducerConfig: "metrics_host", TrainerConfig: "metrics_host"},
    "model": {ProducerConfig: "model", TrainerConfig: "model", EvalConfig: "model"},
    "grpo": {TrainerConfig: "grpo"},
}


def test_every_setting_shared_by_run_produce_and_train_has_one_default() -> None:
    run = default(RunConfig)
    for name, places in SHARED.items():
        for cls, path in places.items():
            assert at(default(cls), path) == run[name], f"{name}: {cls.__name__}.{path}"
    # the producer turns lag into steps with the trainer's batch
    p, t = default(ProducerConfig), default(TrainerConfig)
    assert p["admission"]["trainer_batch"] == t["groups_per_batch"] * t["group_size"]


def test_the_children_of_a_default_run_run_the_default_settings(tmp_path: Path) -> None:
    run = RunConfig()
    trainer = to_mapping(run.trainer("ns", tmp_path))
    alone = default(TrainerConfig)
    for key in ("group_size", "groups_per_batch", "max_staleness", "seed", "model", "grpo"):
        assert trainer[key] == alone[key], key
    producer = to_mapping(run.producer(0, "ns", tmp_path))
    alone = default(ProducerConfig)
    for key in ("concurrency", "group_size", "limits", "model", "partitions", "env"):
        assert producer[key] == alone[key], key
    assert producer["admission"]["max_staleness"] == alone["admission"]["max_staleness"]
    assert producer["sampling"]["temperature"] == alone["sampling"]["temperature"]


def test_every_setting_is_documented() -> None:
    for cls in CONFIGS:
        for path in leaf_paths(cls):
            parts = path.split(".")
            owner: Any = cls
            for part in parts[:-1]:
                owner = type(getattr(owner(), part))
            assert field_docs(owner).get(parts[-1]), f"{cls.__name__}.{path} has no #: comment"


@pytest.mark.parametrize("cls", CONFIGS)
def test_a_resolved_config_written_to_a_file_reads_back_equal(cls: type, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, cls)
    flags = {
        TrainerConfig: ["--group-size", "4", "--grpo.clip-low", "0.1", "--buckets", "32"],
        ServeConfig: ["--stdio", "--env-option", "high=4", "--session-ttl", "5"],
    }.get(cls, ["--model", "small", "--env-option", "high=4"])
    cfg = resolve(cls, parser.parse_args(flags), environ={})
    assert cfg != resolve(cls, {}, environ={})
    path = write_file(cfg, tmp_path / "c.json")
    assert resolve(cls, {}, file=path, environ={}) == cfg
    yaml_path = tmp_path / "c.yaml"
    import yaml

    yaml_path.write_text(yaml.safe_dump(json.loads(path.read_text())))
    assert resolve(cls, {}, file=yaml_path, environ={}) == cfg


def test_flag_over_environment_over_file_over_default(tmp_path: Path) -> None:
    file = tmp_path / "p.json"
    file.write_text(json.dumps({"namespace": "from-file", "concurrency": 7, "group_size": 2}))
    parser = argparse.ArgumentParser()
    add_flags(parser, ProducerConfig)
    env = {"RLSTREAM_NAMESPACE": "from-env"}
    cfg = resolve(ProducerConfig, parser.parse_args(["--config", str(file)]), environ=env)
    assert (cfg.namespace, cfg.concurrency, cfg.group_size) == ("from-env", 7, 2)
    args = parser.parse_args(["--config", str(file), "--namespace", "flag", "--concurrency", "9"])
    cfg = resolve(ProducerConfig, args, environ=env)
    assert (cfg.namespace, cfg.concurrency, cfg.group_size) == ("flag", 9, 2)
    assert cfg.partitions == ProducerConfig.partitions  # untouched: the default


def test_short_flags_reach_their_sections_and_a_preset_can_be_refined() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, ProducerConfig)
    args = parser.parse_args(
        ["--temperature", "0.5", "--seed", "3", "--model", "small", "--model.d-model", "128"]
    )
    cfg = resolve(ProducerConfig, args)
    assert cfg.sampling.temperature == 0.5
    assert cfg.seed == 3 and cfg.sampling.seed == 3  # one flag, both seeds
    assert cfg.model.num_layers == 4 and cfg.model.d_model == 128  # small, then refined


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"grpo": {"learning_rat": 1e-3}}, "unknown setting 'learning_rat' (did you mean"),
        ({"group_size": "eight"}, "TrainerConfig.group_size: 'eight' is not a integer"),
        ({"buckets": "64"}, "TrainerConfig.buckets: '64' is not a list of integer"),
        ({"model": "huge"}, "unknown model 'huge'"),
        ({"model": {"d_model": 130, "num_heads": 4}}, "not a multiple of num_heads"),
        ({"group_size": True}, "is not a integer"),
        ({"max_steps": None, "grpo": None}, "TrainerConfig.grpo: must not be null"),
        # no setting means anything by NaN or infinity (JSON readers take both)
        ({"grpo": {"learning_rate": float("nan")}}, "learning_rate: nan is not a finite number"),
        ({"min_logprob": "-Infinity"}, "min_logprob: '-Infinity' is not a finite number"),
        ({"grpo": {"learning_rate": -1e-3}}, "grpo.learning_rate must be a finite number > 0"),
        ({"grpo": {"clip_low": 1.5}}, "grpo.clip_low must be a finite number in [0, 1]"),
        ({"grpo": {"max_grad_norm": 0}}, "grpo.max_grad_norm must be a finite number > 0"),
        ({"batch_timeout_s": 0}, "batch_timeout_s must be a finite number > 0"),
        # a watchdog that fires at once would restart a trainer group for ever
        ({"stall_timeout_s": 0.001}, "stall_timeout_s must be a finite number >= 10"),
        ({"group_size": 0}, "group_size must be a finite number >= 1"),
        ({"min_logprob": 5}, "min_logprob must be a finite number <= 0"),
        ({"buckets": [1]}, "buckets must be lengths of at least 2"),
        # the producer's (prefixed "producer:")
        ({"producer": 1, "latency_ms": float("nan")}, "latency_ms: nan is not a finite number"),
        (
            {"producer": 1, "limits": {"step_timeout_s": 0}},
            "limits.step_timeout_s must be a finite number > 0",
        ),
        (
            {"producer": 1, "limits": {"max_new_tokens": 0}},
            "limits.max_new_tokens must be a finite number >= 1",
        ),
        ({"producer": 1, "admission": {"poll_s": -1}}, "admission.poll_s must be a finite number"),
        ({"producer": 1, "sampling": {"temperature": 1e400}}, "inf is not a finite number"),
        ({"producer": 1, "partitions": 0}, "partitions must be a finite number >= 1"),
    ],
)
def test_a_bad_setting_is_refused_in_one_sentence_naming_it(
    data: dict[str, Any], message: str, tmp_path: Path
) -> None:
    cls = ProducerConfig if data.pop("producer", None) else TrainerConfig
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidConfigError) as e:
        resolve(cls, {}, file=path)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("text", "name", "message"),
    [
        ("{not json", "c.json", "does not parse"),
        ("[1, 2]", "c.json", "expected an object of settings"),
        ("a: [b", "c.yaml", "does not parse"),
        (None, "missing.json", "No such file"),
    ],
)
def test_a_bad_config_file_is_refused(
    text: str | None, name: str, message: str, tmp_path: Path
) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(InvalidConfigError, match=message):
        resolve(ProducerConfig, {}, file=path)


def test_help_comes_from_the_field_comments_with_the_defaults() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices["produce"].format_help()
    assert "episodes in flight (default: 128)" in " ".join(text.split())
    text = " ".join(sub.choices["train"].format_help().split())
    assert "--learning-rate NUMBER, --grpo.learning-rate NUMBER" in text
    assert "AdamW's peak learning rate (after warm-up) (default: 0.001)" in text


@pytest.mark.parametrize("from_env", [False, True])
def test_every_flag_of_every_command_is_described_with_its_default_once(
    from_env: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from pipeline.cli.main import build_parser, subcommands

    for var in ("BOOTSTRAP", "NAMESPACE", "BROKER_DIR", "RUN_DIR", "SASL_USERNAME", "SSL_CA"):
        if from_env:  # defaults taken from the environment are shown once too
            monkeypatch.setenv(f"RLSTREAM_{var}", "x")
        else:
            monkeypatch.delenv(f"RLSTREAM_{var}", raising=False)
    parsers = subcommands(build_parser())
    assert {p.prog for p in parsers} >= {
        "rlstream report",
        "rlstream topics",
        "rlstream produce",
        "rlstream train",
        "rlstream model init",
    }
    for p in parsers:
        assert p.formatter_class is argparse.ArgumentDefaultsHelpFormatter, p.prog
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            where = f"{p.prog} {'/'.join(a.option_strings) or a.dest}"
            assert a.help and a.help != argparse.SUPPRESS, f"{where} has no description"
            shown_by_formatter = (
                bool(a.option_strings)
                and "%(default)" not in a.help
                and a.default not in (argparse.SUPPRESS, None)
            )
            if shown_by_formatter:  # then the text must not state it a second time
                assert "default" not in a.help.replace("defaults", ""), where
        p.format_help()  # every help renders


def test_the_trainer_takes_log_probabilities_at_the_producers_temperature() -> None:
    def trainer_temperature(**settings: Any) -> float:
        run = resolve(RunConfig, settings, environ={})
        return run.trainer("rlstream", Path("runs/x")).grpo.temperature

    assert trainer_temperature(temperature=0.7) == 0.7
    assert trainer_temperature(temperature=0) == 1.0  # greedy records them at 1
    with pytest.raises(InvalidConfigError, match="set --temperature"):
        resolve(RunConfig, {"grpo": {"temperature": 0.5}}, environ={})
    run = resolve(RunConfig, {"temperature": 0.7, "eval_temperature": 1.0}, environ={})
    assert run.eval_temperature == 1.0
    with pytest.raises(InvalidConfigError, match="eval_temperature must be a finite number"):
        RunConfig(eval_temperature=-1.0)


def _laughs() -> str:
    """A billion-laughs YAML of a few hundred bytes: 9**9 strings once expanded."""
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    return "\n".join([*lines, "env: guess", "env_options:", "  x: *i"]) + "\n"


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("laughs.yaml", _laughs(), r"a YAML alias at line 2: rlstream does not expand aliases"),
        ("inf.yaml", "env_options:\n  high: .inf\n", r"env_options\.high: inf is not a finite"),
        (
            "inf.json",
            '{"env_options": {"high": Infinity}}',
            "env_options.high: inf is not a finite",
        ),
        ("seed.yaml", f"seed: {10**30}\n", r"seed: 10{30} does not fit a 64-bit integer"),
        ("lr.yaml", "grpo:\n  learning_rate: " + "9" * 400 + "\n", "does not fit a 64-bit"),
        ("big.json", None, "larger than 1024 KiB"),
        ("zero.yaml", "/dev/zero", "is not a regular file"),
        ("deep.json", "[" * 50 + "]" * 50, "expected an object"),
        ("nested.json", '{"env_options": ' + '{"a": ' * 150 + "1" + "}" * 151, "nested more than"),
    ],
)
def test_hostile_config_files_are_refused_in_one_sentence(
    name: str, content: str | None, message: str, tmp_path: Path
) -> None:
    import resource
    import time

    path = tmp_path / name
    if content is None:  # 2 GB, sparse
        with path.open("wb") as f:
            f.truncate(2 << 30)
    elif content == "/dev/zero":
        path.symlink_to("/dev/zero")
    else:
        path.write_text(content)
    start, before = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(InvalidConfigError, match=message) as refused:
        resolve(RunConfig, {}, file=path)
    assert time.monotonic() - start < 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 300 << 10  # KiB
    assert len(str(refused.value)) < 500


def test_buckets_follow_the_models_context_unless_given() -> None:
    """A checkpoint with a longer context gets buckets up to it (a tool-listing prompt of
    500 tokens is not too_long for a model of 1024), the built-in model keeps 64-256."""
    from pipeline.policy.config import ModelConfig
    from pipeline.train.config import TrainerConfig

    assert TrainerConfig().buckets == (64, 128, 256)
    assert TrainerConfig(model=ModelConfig(max_len=1024)).buckets == (64, 128, 256, 512, 1024)
    assert TrainerConfig(model=ModelConfig(max_len=48)).buckets == (48,)
    assert TrainerConfig(buckets=(32, 96)).buckets == (32, 96)
