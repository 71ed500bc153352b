"""A Hugging Face Llama, Qwen2 or Qwen3 checkpoint as one GGUF file, the format llama.cpp
loads: llama.cpp's tensor names, the byte-level BPE vocabulary and merges of the
checkpoint's ``tokenizer.json``, float32 tensors (nothing is rounded).

Standalone on purpose (numpy and the ``gguf`` package only): ``rlstream bench decode`` runs
it by path under an interpreter that has no rlstream, and a producer that generates with
a llama.cpp server writes each announced version through it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

#: model_type of config.json -> llama.cpp's architecture
ARCHITECTURES = {"qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama"}

_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    """llama.cpp's name of the Hugging Face tensor ``hf``."""
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    parts = hf.split(".", 3)
    if len(parts) != 4 or parts[:2] != ["model", "layers"]:
        raise ValueError(f"no GGUF name for tensor {hf!r}")
    base, kind = parts[3].rsplit(".", 1)
    if base not in _BLOCK:
        raise ValueError(f"no GGUF name for tensor {hf!r}")
    return f"blk.{parts[2]}.{_BLOCK[base]}.{kind}"


def llama3_rope_factors(config: Mapping[str, Any]) -> np.ndarray | None:
    """The per-frequency factors llama.cpp reads from ``rope_freqs.weight`` for Llama 3's
    rope scaling (None when the configuration has none)."""
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    base = float(config.get("rope_theta", 10000.0))
    factor = float(scaling.get("factor", 8.0))
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old = float(scaling.get("original_max_position_embeddings", 8192))
    out = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def write(
    out: Path,
    config: Mapping[str, Any],
    tokenizer: Mapping[str, Any],
    tensors: Iterable[tuple[str, np.ndarray]],
) -> Path:
    """Write the model of ``config`` (a ``config.json``), ``tokenizer`` (a
    ``tokenizer.json``) and its Hugging Face ``tensors`` as the GGUF file ``out``, whole or
    not at all: it is written beside ``out`` and renamed into place."""
    import gguf

    arch = ARCHITECTURES.get(str(config.get("model_type")))
    if arch is None:
        raise ValueError(
            f"no GGUF writer for model_type {config.get('model_type')!r} "
            f"(one of {', '.join(ARCHITECTURES)})"
        )
    tmp = out.with_name(f".{out.name}.partial")
    w = gguf.GGUFWriter(str(tmp), arch)
    heads = int(config["num_attention_heads"])
    w.add_context_length(int(config.get("max_position_embeddings", 4096)))
    w.add_embedding_length(int(config["hidden_size"]))
    w.add_block_count(int(config["num_hidden_layers"]))
    w.add_feed_forward_length(int(config["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(int(config.get("num_key_value_heads", heads)))
    if config.get("head_dim"):
        w.add_key_length(int(config["head_dim"]))
        w.add_value_length(int(config["head_dim"]))
    w.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = {
        **tokenizer["model"]["vocab"],
        **{a["content"]: a["id"] for a in tokenizer.get("added_tokens", ())},
    }
    special = {a["id"] for a in tokenizer.get("added_tokens", ()) if a.get("special")}
    size = int(config["vocab_size"])
    names = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        if i < size:
            names[i] = text
            types[i] = gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch != "llama" else "llama-bpe")
    w.add_token_list(names)
    w.add_token_types(types)
    merges = tokenizer["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    # prompts arrive as token ids, exactly as the conversation holds them: nothing added
    w.add_add_bos_token(False)
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is not None:
        w.add_eos_token_id(int(eos))
    factors = llama3_rope_factors(config)
    if factors is not None:
        w.add_tensor("rope_freqs.weight", factors)
    for name, value in tensors:
        w.add_tensor(gguf_name(name), np.ascontiguousarray(value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out


def write_checkpoint(model: Path, out: Path) -> Path:
    """The Hugging Face checkpoint directory ``model`` as the GGUF file ``out``."""
    import json

    from safetensors.numpy import load_file

    config = json.loads((model / "config.json").read_text())
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(model.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return write(out, config, tokenizer, tensors.items())
