"""A :class:`ModelConfig` to and from a Hugging Face ``config.json``, and the tensors a
checkpoint of it holds (reading is :mod:`pipeline.policy.hf_format`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.errors import InvalidConfigError
from pipeline.policy.config import ModelConfig
from pipeline.policy.hf_format import DEFAULT_MAX_LEN, MODEL_TYPES, model_fields, read_model_fields


def read_model_config(directory: Path, max_len: int = DEFAULT_MAX_LEN) -> ModelConfig:
    """The :class:`ModelConfig` of the Hugging Face checkpoint in ``directory``."""
    return ModelConfig(**read_model_fields(directory, max_len))


def model_config(
    raw: dict[str, Any], path: str = "", max_len: int = DEFAULT_MAX_LEN
) -> ModelConfig:
    """A :class:`ModelConfig` from the fields of a Hugging Face ``config.json``."""
    return ModelConfig(**model_fields(raw, path, max_len))


def hf_config(cfg: ModelConfig, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` as transformers writes it (top-level ``rope_theta``
    and ``rope_scaling``, which transformers 4 and 5, vLLM and SGLang all read)."""
    if cfg.family not in ("llama", "qwen2", "qwen3"):
        raise InvalidConfigError(
            f"the {cfg.family} model has no Hugging Face form; export a llama, qwen2 or qwen3"
        )
    model_type = cfg.family
    out: dict[str, Any] = {
        "architectures": [MODEL_TYPES[model_type][1]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max(cfg.max_len, cfg.rope_original_max_len)
        if cfg.rope_scaling
        else cfg.max_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": cfg.dtype,
        "use_cache": True,
        "attention_dropout": 0.0,
    }
    if cfg.rope_scaling == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
        }
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
        if model_type == "qwen3":
            out["attention_bias"] = False
    out.update(extra or {})
    return out


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors of a Hugging Face checkpoint of ``cfg``: ``{name: shape}``."""
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.d_ff
    q, kv = cfg.num_heads * hd, cfg.kv_heads * hd
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, d),
        "model.norm.weight": (d,),
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
        if cfg.gated:
            out[p + "mlp.gate_proj.weight"] = (f, d)
        if cfg.qkv_bias:
            out |= {
                p + f"self_attn.{n}_proj.bias": (s,) for n, s in (("q", q), ("k", kv), ("v", kv))
            }
        if cfg.qk_norm:
            out |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    return out
