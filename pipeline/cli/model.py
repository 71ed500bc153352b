"""``rlstream model``: make, inspect and export Hugging Face checkpoints.

- ``model init --family llama|qwen2|qwen3 --preset tiny|0.5b-shape -o DIR``: a randomly
  initialized checkpoint with a tokenizer trained on the fly (no download);
- ``model inspect DIR``: what rlstream reads from a checkpoint, or why it refuses it;
- ``model export WEIGHTS_DIR -o DIR``: a trainer's weights (``weights/vN`` or a
  checkpoint) as a Hugging Face directory that transformers, vLLM or SGLang load.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("model", help="make, inspect and export Hugging Face checkpoints")
    actions = p.add_subparsers(dest="action", required=True)
    init = actions.add_parser(
        "init",
        help="write a randomly initialized Hugging Face checkpoint with its own tokenizer",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    init.add_argument(
        "--family",
        choices=["llama", "qwen2", "qwen3"],
        default="qwen2",
        help="the architecture and config.json style of the checkpoint",
    )
    init.add_argument(
        "--preset",
        choices=["tiny", "small", "0.5b-shape"],
        default="tiny",
        help="its sizes: tiny (fast tests), small (4 layers of 128: learns a task on a CPU) "
        "or the shapes of a 0.5B model",
    )
    init.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    init.add_argument(
        "--init",
        choices=["transformers", "wide"],
        default="transformers",
        help="the weights: as transformers initializes a new model (std 0.02: a start that "
        "trains), or spread wide (every logit shows the family's differences: parity tests)",
    )
    init.add_argument(
        "--tokenizer-text",
        type=Path,
        default=None,
        help="train the byte-level BPE tokenizer on this file: lines of text, or JSONL "
        "conversations (rlstream sft's format: their messages and tool calls); default: a "
        "built-in sample of arithmetic, words and tool calls",
    )
    init.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="the tokenizer's vocabulary at most (default: 1000, 8000 for 0.5b-shape)",
    )
    init.add_argument(
        "-o", "--output", type=Path, required=True, help="the checkpoint directory to write"
    )
    init.set_defaults(func=cmd_init)
    inspect = actions.add_parser("inspect", help="what rlstream reads from a checkpoint")
    inspect.add_argument("directory", type=Path, help="a Hugging Face checkpoint directory")
    inspect.set_defaults(func=cmd_inspect)
    export = actions.add_parser(
        "export", help="write a trainer's weights as a Hugging Face checkpoint"
    )
    export.add_argument("weights", type=Path, help="weights/vN of a run, or a checkpoint")
    export.add_argument(
        "-o", "--output", type=Path, required=True, help="the checkpoint directory to write"
    )
    export.set_defaults(func=cmd_export)


def cmd_init(args: argparse.Namespace) -> int:
    from pipeline.policy.hf_init import init_checkpoint

    out = init_checkpoint(
        args.output,
        args.family,
        args.preset,
        args.seed,
        args.tokenizer_text,
        args.vocab_size,
        args.init,
    )
    trained_on = f" (tokenizer trained on {args.tokenizer_text})" if args.tokenizer_text else ""
    print(f"wrote a random {args.family} ({args.preset}) checkpoint to {out}{trained_on}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from pipeline.errors import InvalidConfigError
    from pipeline.policy import tensorfile
    from pipeline.policy.chat import ChatTokenizer
    from pipeline.policy.hf_config import read_model_config
    from pipeline.policy.hf_weights import check_checkpoint, estimate_bytes

    cfg = read_model_config(args.directory)
    headers = check_checkpoint(cfg)
    tok = ChatTokenizer.load(args.directory)
    # every tensor read once, memory-mapped, one at a time: loading would refuse these
    bad = [n for n, h in sorted(headers.items()) if not tensorfile.all_finite(h, n)]
    if bad:
        raise InvalidConfigError(
            f"{len(bad)} tensors of {args.directory} hold NaN or infinity: "
            f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}"
        )
    info = {
        "model": json.loads(cfg.to_json()),
        "parameters": cfg.num_params(),
        "train_bytes": estimate_bytes(cfg, training=True),
        "tokenizer_id": tok.id,
        "tokenizer_vocab": tok.vocab_size,
        "stop_tokens": sorted(tok.stop_tokens),
    }
    print(json.dumps(info, indent=2))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pipeline.errors import InvalidConfigError
    from pipeline.policy.checkpoint import find_weights, saved_model_config
    from pipeline.policy.hf_weights import export
    from pipeline.policy.lora import restore_weights

    weights = find_weights(args.weights)
    try:
        cfg = saved_model_config(weights)
    except ValueError as e:
        raise InvalidConfigError(str(e)) from None
    params = restore_weights(weights, cfg)
    out = export(cfg, params, args.output)
    print(f"wrote {cfg.family} weights of {weights} to {out}")
    return 0
