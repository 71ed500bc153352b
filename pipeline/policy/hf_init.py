"""``rlstream model init``: a randomly initialized checkpoint in Hugging Face format.

The directory holds what a downloaded Llama or Qwen checkpoint holds (``config.json``,
``model.safetensors``, ``tokenizer.json`` with a byte-level BPE trained here on the fly,
``tokenizer_config.json``, ``chat_template.jinja``, ``generation_config.json``), so tests,
examples and benchmarks run the real loading path without any download. The weights come
from numpy alone (no accelerator runtime), seeded, and are spread wide enough that the
greedy choice is never a near-tie.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import InvalidConfigError
from pipeline.policy import tensorfile
from pipeline.policy.config import ModelConfig
from pipeline.policy.hf_config import hf_config, hf_shapes
from pipeline.policy.template import compile_template

#: sizes by preset name; ``0.5b-shape`` is Qwen2.5-0.5B's configuration
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {
        "d_model": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "d_ff": 128,
        "max_len": 1024,
    },
    "small": {
        "d_model": 128,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 2,
        "d_ff": 384,
        "max_len": 1024,
    },
    "0.5b-shape": {
        "d_model": 896,
        "num_layers": 24,
        "num_heads": 14,
        "num_kv_heads": 2,
        "d_ff": 4864,
        "max_len": 32768,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
    },
}

CHATML = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}\n"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures:\\n<tools>' }}\n"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}\n"
    '{{- \'\\n</tools>\\n\\nFor each call, write <tool_call>\\n{"name": <name>, '
    '"arguments": <arguments>}\\n</tool_call><|im_end|>\\n\' }}\n'
    "{%- elif messages[0].role == 'system' %}\n"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role == 'system' and loop.first %}\n"
    "{%- elif message.role == 'tool' %}\n"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + "
    "'\\n</tool_response><|im_end|>\\n' }}\n"
    "{%- elif message.role == 'assistant' %}\n"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}\n"
    "{%- for call in message.tool_calls or [] %}\n"
    "{%- set f = call.function if call.function is defined else call %}\n"
    '{{- \'<tool_call>\\n{"name": "\' + f.name + \'", "arguments": \' + '
    "(f.arguments if f.arguments is string else f.arguments | tojson) + '}\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{%- set role = 'ipython' if message.role == 'tool' else message.role %}\n"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + (message.content | trim) "
    "+ '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n"
)

#: how the families' tokenizers split text before byte-level BPE (Qwen2 splits every
#: digit, Llama 3 runs of up to three)
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}%s"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: special tokens, pre-tokenizer and template of each family's chat format
FORMATS: dict[str, dict[str, Any]] = {
    "chatml": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "added": ["<tool_call>", "</tool_call>"],
        "bos": None,
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "stops": ["<|im_end|>", "<|endoftext|>"],
        "template": CHATML,
        "split": _SPLIT % "",
        "class": "Qwen2Tokenizer",
    },
    "llama3": {
        "specials": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
        ],
        "added": [],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "pad": "<|end_of_text|>",
        "stops": ["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"],
        "template": LLAMA3,
        "split": _SPLIT % "{1,3}",
        "class": "PreTrainedTokenizerFast",
    },
}


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """Text for the tokenizer to learn from: arithmetic, words, JSON, as the environments
    and tool calls write them."""
    rng = random.Random(seed)
    words = (
        "the of and to a in is you that it for on are with as be at this have from or one "
        "answer question number sum product what how many total left add subtract multiply "
        "divide result tool call calculator search step reward correct wrong please compute "
        "find value equals plus minus times"
    ).split()
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        out.append(f"What is {a} {op} {b}? The answer is {eval(f'{a}{op}{b}')}.")
        out.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
        out.append(json.dumps({"name": rng.choice(words), "arguments": {"x": f"{a}{op}{b}"}}))
    return out


#: bounds of a trained tokenizer's vocabulary (the byte alphabet and specials come first)
MIN_VOCAB, MAX_VOCAB = 300, 262144


def text_sample(path: Path, template: str | None = None) -> Iterator[str]:
    """The text of ``path`` to train a tokenizer on: each line, or for a JSONL file of
    conversations (``rlstream sft``'s format) each conversation as the chat ``template``
    (one of rlstream's own, :data:`FORMATS`, rendered here) lays it out, tools listing and
    tool calls included (without a template, or where it fails, each message's text and
    tool calls' JSON). Bytes that are not UTF-8 are replaced."""
    render = compile_template(template).render if template is not None else None
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                obj = json.loads(line) if line.lstrip().startswith("{") else None
            except (ValueError, RecursionError):
                obj = None
            messages = obj.get("messages") if isinstance(obj, dict) else None
            if not isinstance(obj, dict) or not isinstance(messages, list):
                yield line.rstrip("\n")
                continue
            if render is not None:
                listed = obj.get("tools")
                tools = [
                    t if "function" in t else {"type": "function", "function": t}
                    for t in (listed if isinstance(listed, list) else [])
                    if isinstance(t, dict)
                ]
                try:
                    yield render(messages=messages, tools=tools or None, bos_token="")
                    continue
                except Exception:  # a line the template cannot lay out: its text alone
                    pass
            yield from _message_text(messages)


def _message_text(messages: list[Any]) -> Iterator[str]:
    for m in messages:
        if not isinstance(m, dict):
            continue
        if isinstance(m.get("content"), str):
            yield m["content"]
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else None
            if isinstance(fn, dict):
                yield json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")})


def train_tokenizer(
    fmt: dict[str, Any], vocab_size: int, seed: int, text: Iterable[str] | None = None
) -> Any:
    """A byte-level BPE (as GPT-2, Llama 3 and Qwen use) of ``vocab_size`` tokens at most,
    trained on ``text`` (default: :func:`corpus`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(fmt["split"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=fmt["specials"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    seen = [0]

    def counted(lines: Iterable[str]) -> Iterator[str]:
        for line in lines:
            seen[0] += len(line)
            yield line

    tok.train_from_iterator(counted(corpus(seed) if text is None else text), trainer=trainer)
    if not seen[0]:
        raise InvalidConfigError("the tokenizer's text sample holds no text")
    if fmt["added"]:
        tok.add_tokens(fmt["added"])
    return tok


#: how ``model init`` draws the weights: ``transformers`` as transformers initializes a
#: new model (normal with std ``initializer_range`` 0.02, norms 1, biases 0: a start
#: that trains), ``wide`` spread wide enough that the families' differences show in
#: every logit (the parity tests' checkpoints)
INITS = ("transformers", "wide")


def random_tensors(cfg: ModelConfig, seed: int, init: str = "wide") -> dict[str, np.ndarray]:
    """Hugging Face tensors of a model of ``cfg``, drawn from ``seed`` (:data:`INITS`);
    ``wide``: kernels with standard deviation ``1/sqrt(fan_in)``, embeddings 1, norms
    near 1, biases 0.1."""
    rng = np.random.default_rng(seed)
    out = {}
    if init == "transformers":
        for name, shape in sorted(hf_shapes(cfg).items()):
            if name.endswith("norm.weight") or "layernorm" in name:
                out[name] = np.ones(shape, np.float32)
            elif name.endswith(".bias"):
                out[name] = np.zeros(shape, np.float32)
            else:
                out[name] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        return out
    for name, shape in sorted(hf_shapes(cfg).items()):
        if name.endswith("norm.weight") or "layernorm" in name:
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            a = 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in name or name == "lm_head.weight":
            a = rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = a.astype(np.float32)
    return out


def init_checkpoint(
    out: Path,
    family: str,
    preset: str = "tiny",
    seed: int = 0,
    text: Path | None = None,
    vocab_size: int | None = None,
    init: str = "wide",
) -> Path:
    """Write a random Hugging Face checkpoint of ``family`` (llama, qwen2, qwen3) and
    ``preset`` (tiny, 0.5b-shape) into the empty or new directory ``out``, its tokenizer
    trained on the file ``text`` (:func:`text_sample`; default: a built-in sample of
    arithmetic, words and tool calls) with ``vocab_size`` tokens at most (default 1000
    for tiny and small, 8000 for 0.5b-shape); the weights drawn as ``init`` says (:data:`INITS`)."""
    if family not in ("llama", "qwen2", "qwen3"):
        raise InvalidConfigError(f"family {family!r} is not one of llama, qwen2, qwen3")
    if preset not in SHAPES:
        raise InvalidConfigError(f"preset {preset!r} is not one of {', '.join(SHAPES)}")
    if out.exists() and any(out.iterdir()):
        raise InvalidConfigError(f"{out} is not empty")
    if init not in INITS:
        raise InvalidConfigError(f"init {init!r} is not one of {', '.join(INITS)}")
    if vocab_size is None:
        vocab_size = 8000 if preset == "0.5b-shape" else 1000
    if isinstance(vocab_size, bool) or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise InvalidConfigError(
            f"vocab_size must be an integer in [{MIN_VOCAB}, {MAX_VOCAB}], not {vocab_size}"
        )
    fmt = FORMATS["llama3" if family == "llama" else "chatml"]
    shape = dict(SHAPES[preset])
    if text is not None and not text.is_file():
        raise InvalidConfigError(f"{text} is not a file of text to train the tokenizer on")
    sample = text_sample(text, fmt["template"]) if text is not None else None
    tok = train_tokenizer(fmt, vocab_size, seed, sample)
    size = tok.get_vocab_size(with_added_tokens=True)
    vocab = max(shape.pop("vocab_size", 0), (size + 63) // 64 * 64)
    extra: dict[str, Any] = {}
    if family == "llama":  # Llama 3.x: untied output layer (at the tiny size), llama3 rope
        extra = {
            "rope_scaling": "llama3",
            "rope_factor": 8.0,
            "rope_original_max_len": 256 if preset == "tiny" else 8192,
            "rope_theta": 500000.0,
            "tie_embeddings": preset != "tiny",
        }
    if family == "qwen3":  # an explicit head width other than d_model / num_heads
        extra = {"head_size": shape["d_model"] // shape["num_heads"] * 2}
    cfg = ModelConfig(family=family, vocab_size=vocab, **{**shape, **extra})
    ids = {t: tok.token_to_id(t) for t in fmt["specials"]}
    stops = [ids[t] for t in fmt["stops"]]
    config = hf_config(
        cfg,
        {
            "bos_token_id": ids.get(fmt["bos"]) if fmt["bos"] else None,
            "eos_token_id": stops[0],
            "pad_token_id": ids[fmt["pad"]],
        },
    )
    out.mkdir(parents=True, exist_ok=True)
    tensorfile.write(out / "model.safetensors", random_tensors(cfg, seed, init))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "special": t in fmt["specials"]}
        for t in fmt["specials"] + fmt["added"]
    }
    tok_config = {
        "tokenizer_class": fmt["class"],
        "bos_token": fmt["bos"],
        "eos_token": fmt["eos"],
        "pad_token": fmt["pad"],
        "model_max_length": cfg.max_len,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(fmt["template"])
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": stops, "do_sample": True}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out
