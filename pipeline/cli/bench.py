"""``rlstream bench``: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from pipeline.cli.common import (
    add_broker_args,
    add_env_option_arg,
    add_json_arg,
    add_kafka_args,
    cluster,
    print_result,
)


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks that print ratios measured side by side")
    p.add_argument(
        "which",
        choices=[
            "codec",
            "transport",
            "rollout",
            "weights",
            "trainer",
            "async",
            "telemetry",
            "producers",
            "model",
            "decode",
            "scale",
            "learn",
        ],
        help="the benchmark (docs/benchmarks.md says what each one measures)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face checkpoint directory (model; default: random tiny and "
        "0.5b-shape Qwen2 checkpoints); a preset, tiny, small or base (weights: tiny)",
    )
    p.add_argument(
        "--lora-rank", type=int, default=8, help="rank of the adapters announced (weights)"
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="time per measurement (codec: 2 per round; rollout: 15 per level; telemetry: "
        "10 per window)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds per contender (telemetry: pairs of windows)",
    )
    p.add_argument("--tokens", type=int, default=4096, help="tokens per trajectory")
    p.add_argument(
        "--records",
        type=int,
        default=20000,
        help="records per side and round (transport: enough that start-up is a few percent)",
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        default=None,
        help="median environment latency (rollout: 50, async: 100)",
    )
    p.add_argument(
        "--latency-sigma",
        type=float,
        default=None,
        help="its log-normal shape (rollout: 1, async: 1.5)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="episodes in flight (async, telemetry: 256; weights: 64 per producer)",
    )
    p.add_argument(
        "--eval-episodes", type=int, default=200, help="held-out episodes per policy (async)"
    )
    p.add_argument("--run-dir", default=None, help="runs of the async bench")
    p.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        help="policy versions (async: 4); with a heavy tail, a group waits for its slowest "
        "episode and is that much older when it is trained",
    )
    p.add_argument("--announcements", type=int, default=10, help="checkpoints (weights)")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="measured train steps (trainer: 20, async: 30, producers: 60; learn: the "
        "default run's)",
    )
    p.add_argument("--seeds", type=int, default=None, help="runs of the default (learn: 5)")
    p.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="learn: the seeds are first-seed, first-seed + 1, ... (to extend a sweep)",
    )
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="learn: run every combination of these values of a run setting (repeatable), "
        "e.g. --grid grpo.correction=none,tis,decoupled",
    )
    p.add_argument(
        "--interval", type=float, default=1.5, help="seconds between announcements (weights)"
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="learn: the settings of every run from this rlstream run configuration (JSON "
        "or YAML), e.g. recipes/tool-arithmetic.yaml; --steps, --env and --grid override it",
    )
    p.add_argument(
        "--env",
        default=None,
        help="learn: the environment of every run (any name rlstream env list shows; "
        "default: the default run's)",
    )
    p.add_argument(
        "--swap-kv",
        choices=["keep", "recompute"],
        default="keep",
        help="weights: what the producer does with the key-value rows of episodes in flight "
        "at a swap",
    )
    p.add_argument(
        "--peer-python",
        default=None,
        metavar="PYTHON",
        help="decode: the interpreter that runs the other engines (transformers, "
        "CTranslate2, llama.cpp; default: this one)",
    )
    p.add_argument("--prompt-tokens", type=int, default=128, help="decode: tokens of each prompt")
    p.add_argument("--new-tokens", type=int, default=128, help="decode: tokens generated per row")
    add_env_option_arg(p)
    add_kafka_args(p)
    add_broker_args(p)
    add_json_arg(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from pipeline.bench import (
        asyncrl,
        codec,
        decode,
        learn,
        model,
        producers,
        rollout,
        scale,
        telemetry,
        trainer,
        transport,
        weights,
    )

    benches: dict[str, Callable[[argparse.Namespace, Any], dict[str, Any]]] = {
        "async": asyncrl.run,
        "codec": codec.run,
        "transport": transport.run,
        "rollout": rollout.run,
        "weights": weights.run,
        "trainer": trainer.run,
        "telemetry": telemetry.run,
        "producers": producers.run,
        "model": model.run,
        "decode": decode.run,
        "scale": scale.run,
        "learn": learn.run,
    }
    result = benches[args.which](args, cluster(args))
    print_result(args, result, format_bench(result))
    return 0


def format_bench(result: dict[str, Any]) -> str:
    lines = [f"bench {result['bench']}"]
    for section in ("figures", "ratios"):
        for k, v in result.get(section, {}).items():
            lines.append(
                f"  {section[:-1]:6} {k:32} {v:,.4g}"
                if isinstance(v, float)
                else f"  {section[:-1]:6} {k:32} {v}"
            )
    for k, v in result.get("goals", {}).items():
        lines.append(f"  goal   {k:32} {v}")
    return "\n".join(lines)
