"""One engine's generation speed, in a process of its own: ``rlstream bench decode`` runs
this file once per engine (``python decode_engines.py ENGINE SPEC.json``) and reads the
one JSON line it prints.

Every engine gets the same checkpoint, the same prompts (token ids), the same number of new
tokens (end-of-sequence ignored: every row generates them all), the same threads and
temperature. Prefill is timed as the call that generates one token; decode tokens/s is
``rows * (new - 1) / (t(new) - t(1))``. Each engine is warmed up first (rlstream compiles,
the others allocate). Engines that are not rlstream import nothing of rlstream: they run
under any interpreter that has them (``--peer-python``).

- ``rlstream``: the producers' :class:`~pipeline.policy.sampler.DecodeEngine`, one slot per
  row; a GRPO group's prompt is prefilled once and copied to its members, as in a run.
- ``transformers``: ``generate`` on PyTorch, batched, with its key-value cache.
- ``ctranslate2``: ``Generator.generate_batch`` in float32, the checkpoint converted by its
  own converter (``TransformersConverter``).
- ``llama_cpp``: llama-cpp-python on a GGUF F32 file (``pipeline/policy/gguf_file.py``),
  one sequence at a time (the batch its high-level API supports).
- ``roofline``: the machine's float32 matrix-product FLOP/s (the best of NumPy's BLAS and
  XLA on a 4096 x 4096 product) and its memory bandwidth (a copy of 1 GiB, bytes read and
  written, as STREAM counts them).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

# run by path: this folder's modules (model.py, trainer.py ...) must not shadow packages
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import numpy as np  # noqa: E402


def _timed(generate: Any, new: int) -> tuple[float, float]:
    """(seconds for one new token, seconds for ``new``) after a warm-up call."""
    generate(2)
    t0 = time.perf_counter()
    generate(1)
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    generate(new)
    return one, time.perf_counter() - t0


def run_rlstream(spec: dict[str, Any]) -> tuple[float, float]:
    import jax

    from pipeline.policy.config import SamplingConfig
    from pipeline.policy.hf_config import read_model_config
    from pipeline.policy.hf_weights import load_model
    from pipeline.policy.sampler import DecodeEngine

    prompts = spec["prompts"]
    rows = len(prompts)
    cfg = read_model_config(Path(spec["model"]), max_len=len(prompts[0]) + spec["new"] + 1)
    engine = DecodeEngine(
        load_model(cfg), rows, SamplingConfig(temperature=spec["temperature"]), chunk=64
    )

    def generate(n: int) -> None:
        for s, p in enumerate(prompts):
            engine.reset(s)
            engine.append(s, p)
        for _ in range(n):
            engine.step(list(range(rows)))
        jax.block_until_ready(engine.cache)

    return _timed(generate, spec["new"])


def run_transformers(spec: dict[str, Any]) -> tuple[float, float]:
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32
    ).eval()
    ids = torch.tensor(spec["prompts"])
    sample = spec["temperature"] > 0
    options: dict[str, Any] = (
        {"do_sample": True, "temperature": spec["temperature"], "top_k": 0, "top_p": 1.0}
        if sample
        else {"do_sample": False}
    )

    def generate(n: int) -> None:
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
                **options,
            )

    return _timed(generate, spec["new"])


def run_ctranslate2(spec: dict[str, Any]) -> tuple[float, float]:
    import ctranslate2
    from ctranslate2.converters import TransformersConverter

    out = Path(spec["work"]) / "ctranslate2"
    if not (out / "model.bin").exists():
        TransformersConverter(spec["model"]).convert(str(out), force=True)
    generator = ctranslate2.Generator(
        str(out),
        device="cpu",
        compute_type="float32",
        intra_threads=spec["threads"],
        inter_threads=1,
    )
    vocab = json.loads((out / "vocabulary.json").read_text())
    tokens = [[vocab[t] for t in p] for p in spec["prompts"]]
    rows = len(tokens)
    # sampling_topk 0: the whole distribution; 1: greedy
    topk = 0 if spec["temperature"] > 0 else 1

    def generate(n: int) -> None:
        generator.generate_batch(
            tokens,
            max_length=n,
            min_length=n,
            sampling_topk=topk,
            sampling_temperature=max(spec["temperature"], 1e-6),
            include_prompt_in_result=False,
            max_batch_size=rows,
        )

    return _timed(generate, spec["new"])


def run_llama_cpp(spec: dict[str, Any]) -> tuple[float, float]:
    import llama_cpp

    gguf_path = Path(spec["work"]) / "model-f32.gguf"
    if not gguf_path.exists():
        write_gguf(Path(spec["model"]), gguf_path)
    prompts = spec["prompts"]
    llm = llama_cpp.Llama(
        str(gguf_path),
        n_ctx=len(prompts[0]) + spec["new"] + 8,
        n_batch=len(prompts[0]),
        n_threads=spec["threads"],
        n_threads_batch=spec["threads"],
        logits_all=False,
        verbose=False,
    )
    temperature = spec["temperature"]

    def generate(n: int) -> None:
        for p in prompts:
            made = 0
            for _ in llm.generate(p, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, reset=True):
                made += 1
                if made >= n:
                    break

    return _timed(generate, spec["new"])


def write_gguf(model: Path, out: Path) -> None:
    """The checkpoint as GGUF F32, by rlstream's writer (``pipeline/policy/gguf_file.py``,
    loaded by path: this interpreter may not have rlstream)."""
    import importlib.util

    path = _HERE.parent / "policy" / "gguf_file.py"
    spec = importlib.util.spec_from_file_location("rlstream_gguf_file", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_checkpoint(model, out)


def run_roofline(spec: dict[str, Any]) -> dict[str, float]:
    n = 4096
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        a @ a
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    try:
        import jax
        import jax.numpy as jnp

        x = jnp.asarray(a)
        mm = jax.jit(lambda u: u @ u)
        mm(x).block_until_ready()
        for _ in range(3):
            t0 = time.perf_counter()
            mm(x).block_until_ready()
            best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    except ImportError:
        pass
    src = np.ones(1 << 28, np.float32)  # 1 GiB
    dst = np.empty_like(src)
    np.copyto(dst, src)
    bandwidth = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        bandwidth = max(bandwidth, 2 * src.nbytes / (time.perf_counter() - t0))
    return {"flops_per_s": best, "bytes_per_s": bandwidth}


RUNNERS = {
    "rlstream": run_rlstream,
    "transformers": run_transformers,
    "ctranslate2": run_ctranslate2,
    "llama_cpp": run_llama_cpp,
}


def main(argv: list[str]) -> int:
    engine, spec_path = argv
    spec = json.loads(Path(spec_path).read_text())
    if engine == "roofline":
        print(json.dumps(run_roofline(spec)), flush=True)
        return 0
    one, total = RUNNERS[engine](spec)
    rows, prompt, new = len(spec["prompts"]), len(spec["prompts"][0]), spec["new"]
    result = {
        "prefill_tokens_per_s": rows * prompt / one,
        "decode_tokens_per_s": rows * (new - 1) / max(total - one, 1e-9),
        "seconds": one + total,
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
