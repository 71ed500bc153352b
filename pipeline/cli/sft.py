"""``rlstream sft``: supervised fine-tuning on conversations, the warm start before RL."""

from __future__ import annotations

import argparse
from typing import Any

from pipeline.cli.common import add_json_arg, print_result
from pipeline.settings import add_flags, resolve, write_file


def register(sub: Any) -> None:
    from pipeline.train.config import SFTConfig

    p = sub.add_parser(
        "sft",
        help="fine-tune a Hugging Face checkpoint on conversations (JSONL chat format)",
        description="Supervised fine-tuning, loss on the assistant's tokens only, "
        "conversations packed into rows; writes OUT/model (the checkpoint rlstream run "
        "--model starts from), OUT/metrics.jsonl and OUT/loss.png.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_flags(p, SFTConfig)
    add_json_arg(p)
    p.set_defaults(func=cmd_sft, settings=SFTConfig)


def cmd_sft(args: argparse.Namespace) -> int:
    from pipeline import compile_cache
    from pipeline.launch.stop import process_flag
    from pipeline.train.config import SFTConfig
    from pipeline.train.sft import run_sft

    cfg = resolve(SFTConfig, args)
    compile_cache.enable()
    cfg.out.mkdir(parents=True, exist_ok=True)
    write_file(cfg, cfg.out / "sft.json")
    figures = run_sft(cfg, lambda s: print(s, flush=True), process_flag().event)
    print_result(args, {"figures": figures}, f"wrote {figures['model']}")
    return 0
