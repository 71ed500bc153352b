"""``rlstream bench decode``: generation speed side by side with the CPU engines users pick,
and beside the machine's own limit.

One checkpoint (``--model DIR``, or random Qwen2 ``tiny`` and ``0.5b-shape`` checkpoints
that ``rlstream model init`` writes), the same prompts for every engine: GRPO groups, 8
groups of 8 samples of one prompt each, ``--prompt-tokens`` (128) tokens per prompt,
``--new-tokens`` (128) generated per row, greedy and at temperature 1. Each engine runs in a
process of its own (:mod:`pipeline.bench.decode_engines` says how each is driven), one after
the other, with the machine's cores as threads: rlstream's decode engine, transformers
``generate`` on PyTorch, CTranslate2 and llama.cpp (llama-cpp-python; one sequence at a
time, the batch its API supports, on 2 of the prompts). The peers run under
``--peer-python`` (default: this interpreter); one that is not installed there is reported
as not measured, with what to install.

The roofline: a decode step of ``B`` rows must read every weight once and do ``2 * N``
FLOPs per row (``N`` the parameters in matrix products, attention over the context
besides), so it takes at least ``max(bytes / bandwidth, B * flops / peak)``; prefill at
least ``flops / peak`` per token. Bandwidth and peak are measured in the same run (a 1 GiB
copy; the best 4096-square float32 product of NumPy and XLA).

Ratios are rlstream's tokens/s over each peer's (``vs_transformers``, ``vs_ctranslate2``,
``vs_llama_cpp``, ``vs_best_cpu_engine``: over the faster of CTranslate2 and llama.cpp),
for decode and prefill, greedy and sampled; the headline ``ratios`` and
``figures.fraction_of_roofline`` are the large checkpoint's decode, the lower of its greedy
and sampled figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import InvalidConfigError
from pipeline.policy.config import ModelConfig
from pipeline.policy.hf_config import read_model_config
from pipeline.policy.hf_init import init_checkpoint

ENGINE_SCRIPT = Path(__file__).with_name("decode_engines.py")
PEERS = ("transformers", "ctranslate2", "llama_cpp")
#: what to install for each peer (all of them: ``pip install 'rlstream[bench-peers]'`` in an
#: environment apart, given as --peer-python)
INSTALL = {
    "transformers": "pip install torch transformers",
    "ctranslate2": "pip install ctranslate2 torch transformers (its converter reads the "
    "checkpoint with transformers)",
    "llama_cpp": "pip install llama-cpp-python gguf safetensors",
}
GROUPS, GROUP_SIZE = 8, 8
#: prompts llama.cpp generates for, one after the other
LLAMA_ROWS = 2
MODES = {"greedy": 0.0, "sampled": 1.0}
CHILD_TIMEOUT_S = 3600


def _child(python: str, engine: str, spec: dict[str, Any], work: Path) -> dict[str, Any] | str:
    """The engine's figures, or why there are none (one line)."""
    path = work / f"spec-{engine}.json"
    path.write_text(json.dumps(spec))
    threads = str(spec["threads"])
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    try:
        done = subprocess.run(
            [python, str(ENGINE_SCRIPT), engine, str(path)],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return f"did not finish in {CHILD_TIMEOUT_S} s"
    except OSError as e:
        return f"could not start {python}: {e}"
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        try:
            return dict(json.loads(lines[-1]))
        except ValueError:
            pass
    err = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    last = err[-1] if err else f"exit status {done.returncode}"
    if "ModuleNotFoundError" in last or "ImportError" in last:
        return f"not installed ({last.split(':', 1)[-1].strip()}): {INSTALL.get(engine, '')}"
    return last[-300:]


def roofline(
    cfg: ModelConfig, rows: int, context: int, machine: dict[str, float]
) -> dict[str, float]:
    """Tokens/s no engine can beat on this machine (see the module docstring)."""
    lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    matmul = cfg.num_params() - lookup
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
    flops = 2 * matmul + attention
    itemsize = np.dtype(cfg.dtype).itemsize
    kv = 2 * cfg.num_layers * cfg.kv_heads * cfg.head_dim * context * itemsize * rows
    step_s = max(
        (matmul * itemsize + kv) / machine["bytes_per_s"], rows * flops / machine["flops_per_s"]
    )
    return {
        "roofline_decode_tokens_per_s": rows / step_s,
        "roofline_prefill_tokens_per_s": machine["flops_per_s"] / flops,
    }


def _ratios(got: dict[str, dict[str, Any]], phase: str) -> dict[str, float]:
    key = f"{phase}_tokens_per_s"
    ours = got["rlstream"][key]
    out = {f"vs_{p}": ours / got[p][key] for p in PEERS if p in got}
    best = [got[p][key] for p in ("ctranslate2", "llama_cpp") if p in got]
    if best:
        out["vs_best_cpu_engine"] = ours / max(best)
    return out


def _measure_engines(
    title: str,
    python: str,
    spec: dict[str, Any],
    prompts: list[list[int]],
    llama_prompts: list[list[int]],
    missing: dict[str, str],
) -> dict[str, dict[str, Any]]:
    """Each engine's figures for ``spec``; a peer that failed is noted in ``missing`` and
    not tried again (rlstream's own engine failing ends the bench)."""
    work = Path(spec["work"])
    got: dict[str, dict[str, Any]] = {}
    for engine in ("rlstream", *PEERS):
        if engine in missing:
            continue
        mine = {**spec, "prompts": llama_prompts if engine == "llama_cpp" else prompts}
        print(f"{title}: {engine} ...", flush=True)
        result = _child(sys.executable if engine == "rlstream" else python, engine, mine, work)
        if isinstance(result, str):
            if engine == "rlstream":
                raise RuntimeError(f"bench decode: rlstream's engine failed: {result}")
            missing[engine] = result
            print(f"  {engine}: not measured: {result}", flush=True)
            continue
        got[engine] = result
        print(
            f"  prefill {result['prefill_tokens_per_s']:,.0f} tok/s, "
            f"decode {result['decode_tokens_per_s']:,.1f} tok/s",
            flush=True,
        )
    return got


def run(args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    python = args.peer_python or sys.executable
    threads = os.cpu_count() or 1
    prompt_len, new = args.prompt_tokens, args.new_tokens
    if prompt_len < 1 or new < 2:
        raise InvalidConfigError(
            f"bench decode needs --prompt-tokens >= 1 and --new-tokens >= 2, not {prompt_len} "
            f"and {new}"
        )
    figures: dict[str, Any] = {"threads": threads}
    ratios: dict[str, float] = {}
    goals: dict[str, str] = {}
    missing: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print("measuring the machine (a float32 matrix product, a 1 GiB copy) ...", flush=True)
        machine = _child(sys.executable, "roofline", {"threads": threads}, work)
        if isinstance(machine, str):
            raise RuntimeError(f"bench decode: the roofline measurement failed: {machine}")
        figures["machine_flops_per_s"] = machine["flops_per_s"]
        figures["machine_bytes_per_s"] = machine["bytes_per_s"]
        if args.model:
            targets = [("model", Path(args.model))]
        else:
            targets = []
            for preset in ("tiny", "0.5b-shape"):
                print(f"writing a random qwen2 {preset} checkpoint ...", flush=True)
                targets.append((preset, init_checkpoint(work / preset, "qwen2", preset)))
        rng = np.random.default_rng(0)
        for label, directory in targets:
            cfg = read_model_config(directory, max_len=prompt_len + new + 1)
            rows = GROUPS * GROUP_SIZE
            high = min(cfg.vocab_size, 1000)
            groups = [rng.integers(3, high, prompt_len).tolist() for _ in range(GROUPS)]
            prompts = [groups[i // GROUP_SIZE] for i in range(rows)]
            limits = roofline(cfg, rows, prompt_len + new // 2, machine)
            figures.update({f"{label}.{k}": v for k, v in limits.items()})
            engine_work = work / f"{label}-engines"
            engine_work.mkdir()
            fractions = []
            for mode, temperature in MODES.items():
                spec = {
                    "model": str(directory),
                    "new": new,
                    "temperature": temperature,
                    "threads": threads,
                    "work": str(engine_work),
                }
                got = _measure_engines(
                    f"{label} {mode}", python, spec, prompts, groups[:LLAMA_ROWS], missing
                )
                for engine, result in got.items():
                    for k in ("prefill_tokens_per_s", "decode_tokens_per_s"):
                        figures[f"{label}.{mode}.{engine}.{k}"] = result[k]
                for phase in ("decode", "prefill"):
                    for k, v in _ratios(got, phase).items():
                        ratios[f"{label}.{mode}.{phase}.{k}"] = v
                fraction = (
                    got["rlstream"]["decode_tokens_per_s"] / limits["roofline_decode_tokens_per_s"]
                )
                figures[f"{label}.{mode}.fraction_of_roofline"] = fraction
                fractions.append(fraction)
            if label == targets[-1][0]:  # the headline: the large checkpoint's decode
                figures["fraction_of_roofline"] = min(fractions)
                for key in (
                    "vs_transformers",
                    "vs_ctranslate2",
                    "vs_llama_cpp",
                    "vs_best_cpu_engine",
                ):
                    both = [ratios.get(f"{label}.{m}.decode.{key}") for m in MODES]
                    if all(v is not None for v in both):
                        ratios[key] = min(v for v in both if v is not None)
                goals.update(_goals(label, ratios, figures["fraction_of_roofline"]))
    if missing:
        figures["not_measured"] = missing
    return {"bench": "decode", "figures": figures, "ratios": ratios, "goals": goals}


def _goals(label: str, ratios: dict[str, float], fraction: float) -> dict[str, str]:
    def verdict(value: float | None, floor: float) -> str:
        if value is None:
            return "not measured"
        return f"{'met' if value >= floor else 'missed'} ({value:.2f})"

    return {
        f"{label} decode >= 2x transformers": verdict(ratios.get("vs_transformers"), 2.0),
        f"{label} decode >= best CPU engine": verdict(ratios.get("vs_best_cpu_engine"), 1.0),
        f"{label} decode >= 50% of the roofline": verdict(fraction, 0.5),
    }
