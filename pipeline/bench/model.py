"""``rlstream bench model``: what the policy costs to sample and to train.

For a Hugging Face checkpoint (``--model DIR``), or else for two random Qwen2-family
checkpoints that ``rlstream model init`` writes (``tiny`` and ``0.5b-shape``, Qwen2.5-0.5B's
configuration): prefill and decode tokens/s of the key-value-cached sampler (prefill also
for GRPO groups of 8 conversations that share a prompt, prefilled once), train-step
tokens/s of the GRPO step the trainer runs (Adam, donated state, no reference copy), and
the step's peak resident memory next to what its parameters, gradients and optimizer
state take. Model FLOPs per trained token are ``6 * N + 12 * L * H * Q * T`` (PaLM, appendix
B): ``N`` the parameters that take part in matrix products (all but the input embedding
table, a lookup; a tied table counts once, as the output head), ``L`` layers, ``H`` heads
of ``Q`` dimensions, ``T`` the sequence length (attention over the whole sequence, not
halved for the causal mask). On an accelerator with a known peak for the model's dtype
(bfloat16; float32 matrix products run as TF32 at JAX's default precision, as FP32 at
``highest``), utilization is reported too.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pipeline.policy.config import ModelConfig, SamplingConfig
from pipeline.policy.hf_config import read_model_config
from pipeline.policy.hf_init import init_checkpoint
from pipeline.policy.hf_weights import initial_model
from pipeline.policy.sampler import DecodeEngine
from pipeline.train.config import GRPOConfig
from pipeline.train.grpo import init_state, make_train_step
from pipeline.train.objective import Batch

#: dense peak FLOP/s of accelerators by ``device_kind`` prefix: bfloat16, TF32 (float32
#: at JAX's default matmul precision) and FP32 (at ``highest``), from the vendors' sheets
PEAK_FLOPS = {
    "NVIDIA H200": {"bfloat16": 989e12, "tf32": 495e12, "float32": 67e12},
    "NVIDIA H100": {"bfloat16": 989e12, "tf32": 495e12, "float32": 67e12},
    "NVIDIA A100": {"bfloat16": 312e12, "tf32": 156e12, "float32": 19.5e12},
}

#: (slots, prompt tokens, decode steps, train rows, train tokens per row) by size
SHAPES = {"tiny": (16, 128, 64, 8, 256), "large": (8, 128, 16, 2, 256)}


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to VmRSS
    except OSError:
        pass


def _peak_flops(dtype: str) -> float | None:
    """The device's dense peak for matrix products in ``dtype`` (None: not known)."""
    kind = jax.devices()[0].device_kind
    peaks = next((v for k, v in PEAK_FLOPS.items() if kind.startswith(k)), None)
    if peaks is None:
        return None
    precision = getattr(jax.config, "jax_default_matmul_precision", None)
    if dtype == "float32" and precision not in ("highest", "float32"):
        dtype = "tf32"
    return peaks.get(dtype)


def train_flops_per_token(cfg: ModelConfig, length: int) -> float:
    """``6 * N + 12 * L * H * Q * T`` (see the module docstring)."""
    lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    matmul = cfg.num_params() - lookup
    return 6 * matmul + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length


def measure(cfg: ModelConfig, shape: tuple[int, int, int, int, int]) -> dict[str, float]:
    slots, prompt, decode_steps, rows, length = shape
    n = cfg.num_params()
    out: dict[str, float] = {"parameters": float(n)}
    model = initial_model(cfg, training=True)
    rng = np.random.default_rng(0)

    engine = DecodeEngine(model, slots, SamplingConfig(temperature=1.0), chunk=64)
    for round_ in range(2):  # the first round compiles
        for s in range(slots):
            engine.reset(s)
            engine.append(s, [int(t) for t in rng.integers(0, cfg.vocab_size, prompt)])
        t0 = time.perf_counter()
        engine.flush()
        jax.block_until_ready(engine.cache)
        prefill_s = time.perf_counter() - t0
        engine.step(list(range(slots)))
        t0 = time.perf_counter()
        for _ in range(decode_steps if round_ else 1):
            engine.step(list(range(slots)))
        decode_s = time.perf_counter() - t0
    out["prefill_tokens_per_s"] = slots * prompt / prefill_s
    out["decode_tokens_per_s"] = slots * decode_steps / decode_s
    # GRPO groups: the members of a group of 8 share one prompt, prefilled once
    group = min(8, slots)
    for _ in range(2):  # the first round compiles the copy
        prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, prompt)] for _ in range(slots)]
        for s in range(slots):
            engine.reset(s)
            engine.append(s, prompts[s - s % group])
        t0 = time.perf_counter()
        engine.flush()
        jax.block_until_ready(engine.cache)
        group_s = time.perf_counter() - t0
    out["group_prefill_tokens_per_s"] = slots * prompt / group_s
    out["group_prefill_vs_prefill"] = prefill_s / group_s
    del engine
    gc.collect()

    grpo = GRPOConfig()
    tx = grpo.optimizer()
    graphdef, state = init_state(model, tx, reference=False)
    del model
    step = make_train_step(graphdef, grpo, tx, donate=True)
    tokens = rng.integers(0, cfg.vocab_size, (rows, length)).astype(np.int32)
    mask = np.ones((rows, length), np.float32)
    mask[:, : length // 4] = 0  # a prompt the policy did not write
    batch = Batch(
        tokens,
        mask,
        np.full((rows, length), -2.0, np.float32),
        rng.standard_normal(rows).astype(np.float32),
        np.ones(rows, np.float32),
    )
    state, _ = step(state, batch)  # compiles
    jax.block_until_ready(state)
    gc.collect()
    _reset_peak()
    base = _rss("VmRSS")
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    train_s = time.perf_counter() - t0
    peak = _rss("VmHWM")
    itemsize = np.dtype(cfg.dtype).itemsize
    out["train_tokens_per_s"] = rows * length / train_s
    out["train_step_s"] = train_s
    out["model_flops_per_token"] = train_flops_per_token(cfg, length)
    out["model_flops_per_s"] = out["model_flops_per_token"] * rows * length / train_s
    out["peak_rss_gib"] = peak / 2**30
    out["rss_before_step_gib"] = base / 2**30
    # parameters + gradients + Adam's two moments
    out["state_and_grads_gib"] = 4 * n * itemsize / 2**30
    out["peak_over_state_and_grads"] = peak / (4 * n * itemsize)
    peak_flops = _peak_flops(cfg.dtype)
    if peak_flops is not None:
        out["train_mfu"] = out["model_flops_per_s"] / peak_flops
    del state
    gc.collect()
    return out


def run(args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    figures: dict[str, float] = {}
    goals: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            targets = [("model", Path(args.model), "large")]
        else:
            targets = []
            for preset in ("tiny", "0.5b-shape"):
                print(f"writing a random qwen2 {preset} checkpoint ...", flush=True)
                d = init_checkpoint(Path(tmp) / preset, "qwen2", preset)
                targets.append((preset, d, "tiny" if preset == "tiny" else "large"))
        for label, directory, size in targets:
            cfg = read_model_config(directory, max_len=512)
            print(f"measuring {label} ({cfg.num_params() / 1e6:.1f}M parameters) ...", flush=True)
            for k, v in measure(cfg, SHAPES[size]).items():
                figures[f"{label}.{k}"] = v
            if size == "large":
                ratio = figures[f"{label}.peak_over_state_and_grads"]
                goals[f"{label} peak memory within 1.5x of state and gradients"] = (
                    f"{'met' if ratio <= 1.5 else 'missed'} ({ratio:.2f}x)"
                )
    return {
        "bench": "model",
        "device": jax.devices()[0].device_kind,
        "figures": figures,
        "goals": goals,
    }
