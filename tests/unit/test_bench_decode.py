"""``rlstream bench decode``: the roofline's arithmetic, engines that are not installed, and
a run on a tiny checkpoint where only rlstream's engine is installed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from pipeline.bench import decode
from pipeline.errors import InvalidConfigError
from pipeline.policy.config import ModelConfig
from pipeline.policy.hf_init import init_checkpoint


def test_roofline_is_bandwidth_bound_for_one_row_and_compute_bound_for_many() -> None:
    cfg = ModelConfig(d_model=64, num_layers=2, num_heads=4, d_ff=128, max_len=256)
    matmul = cfg.num_params()  # tied: the table is the output head's product
    flops = 2 * matmul + 4 * 2 * 4 * 16 * 100
    machine = {"flops_per_s": 1e11, "bytes_per_s": 1e10}
    one = decode.roofline(cfg, 1, 100, machine)
    kv_one = 2 * 2 * 4 * 16 * 100 * 4  # keys and values of 100 positions, float32
    assert one["roofline_decode_tokens_per_s"] == pytest.approx(1e10 / (4 * matmul + kv_one))
    assert one["roofline_prefill_tokens_per_s"] == pytest.approx(1e11 / flops)
    many = decode.roofline(cfg, 64, 100, {**machine, "bytes_per_s": 1e14})
    assert many["roofline_decode_tokens_per_s"] == pytest.approx(1e11 / flops)
    # every row reads its own keys and values: enough rows are bandwidth-bound again
    crowd = decode.roofline(cfg, 100_000, 100, machine)
    kv = kv_one * 100_000
    assert crowd["roofline_decode_tokens_per_s"] == pytest.approx(
        100_000 * 1e10 / (4 * matmul + kv)
    )


def test_an_engine_that_is_not_installed_is_named_with_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "site" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'llama_cpp'\")\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    spec = {"model": str(tmp_path), "prompts": [[1, 2]], "new": 2, "temperature": 0.0}
    got = decode._child(
        sys.executable, "llama_cpp", {**spec, "threads": 1, "work": str(tmp_path)}, tmp_path
    )
    assert (
        isinstance(got, str)
        and got.startswith("not installed")
        and "pip install llama-cpp-python" in got
    )
    missing_python = decode._child(
        str(tmp_path / "no-python"), "ctranslate2", {"threads": 1}, tmp_path
    )
    assert isinstance(missing_python, str) and "could not start" in missing_python


def _args(**kw: object) -> argparse.Namespace:
    base = {"peer_python": None, "prompt_tokens": 16, "new_tokens": 4, "model": None}
    return argparse.Namespace(**{**base, **kw})


def test_a_run_measures_rlstream_and_reports_the_peers_it_could_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the peers run under an interpreter where none of them can be imported
    blocked = tmp_path / "site"
    for name in ("torch", "transformers", "ctranslate2", "llama_cpp"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ModuleNotFoundError({name!r})\n")
    monkeypatch.setenv("PYTHONPATH", str(blocked))
    model = init_checkpoint(tmp_path / "tiny", "qwen2", "tiny")
    monkeypatch.setattr(decode, "MODES", {"sampled": 1.0})
    result = decode.run(_args(model=str(model), peer_python=sys.executable), None)
    figures = result["figures"]
    assert figures["model.sampled.rlstream.decode_tokens_per_s"] > 0
    assert figures["model.sampled.rlstream.prefill_tokens_per_s"] > 0
    assert 0 < figures["fraction_of_roofline"] == figures["model.sampled.fraction_of_roofline"]
    assert set(figures["not_measured"]) == {"transformers", "ctranslate2", "llama_cpp"}
    assert "pip install" in figures["not_measured"]["ctranslate2"]
    assert result["ratios"] == {}
    assert set(result["goals"].values()) >= {"not measured"}


@pytest.mark.parametrize("prompt,new", [(0, 4), (16, 1)])
def test_sizes_that_measure_nothing_are_refused(prompt: int, new: int) -> None:
    with pytest.raises(InvalidConfigError, match="--new-tokens >= 2"):
        decode.run(_args(prompt_tokens=prompt, new_tokens=new), None)
