"""``rlstream produce``: one rollout producer process."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pipeline import compile_cache
from pipeline.cli.common import (
    add_json_arg,
    add_kafka_args,
    add_telemetry_arg,
    kafka_config,
    print_result,
    run_process,
)
from pipeline.launch.stop import process_flag
from pipeline.settings import add_flags, resolve


def register(sub: Any) -> None:
    from pipeline.rollout.config import ProducerConfig

    p = sub.add_parser(
        "produce",
        help="run a rollout producer: concurrent episodes into Kafka",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_flags(p, ProducerConfig)
    add_telemetry_arg(p)
    add_kafka_args(p)
    add_json_arg(p)
    p.set_defaults(func=cmd_produce, settings=ProducerConfig)


def cmd_produce(args: argparse.Namespace) -> int:
    stop = process_flag()  # a SIGTERM since the process began stops it once it runs
    from connectors import stats as connector_stats
    from pipeline.kafka.topics import ensure_topics, namespace_topics
    from pipeline.rollout.config import ProducerConfig
    from pipeline.rollout.producer import RolloutProducer
    from pipeline.rollout.status import StatusFile

    cfg = resolve(ProducerConfig, args)
    compile_cache.enable()
    if not cfg.checkpoint_roots:
        print(
            "rlstream: warning: --checkpoint-root none: this producer samples its initial "
            "policy and never loads the weights a trainer announces (give the trainer's "
            "--run-dir or a folder above it, or set RLSTREAM_CHECKPOINT_ROOT)",
            file=sys.stderr,
            flush=True,
        )
    from connectors.base import env_name, make

    make(cfg.env, **cfg.env_kwargs)  # an unknown environment is refused before connecting
    topic_env = env_name(cfg.env, cfg.env_kwargs)
    kafka = kafka_config(args)
    ensure_topics(kafka, namespace_topics(cfg.namespace, [topic_env], cfg.partitions))
    start = time.monotonic()
    status = StatusFile(cfg.status_file) if cfg.status_file else None

    def progress(p: Any) -> None:
        if stop:
            p.stop()
        st = p.stats
        done = sum(st.finished.values())
        rate = done / max(1e-9, time.monotonic() - start)
        if status is not None:
            status.write(p)
        print(
            f"episodes={done} rate={rate:.1f}/s in_flight={p.in_flight} "
            f"paused={'yes' if p.gate.paused else 'no'} lag={p.gate.lag} version={p.version} "
            f"sent={p.writer.sent} failed={p.writer.failed}",
            flush=True,
        )

    producer = RolloutProducer(cfg, kafka, on_progress=progress)
    metrics = (cfg.metrics_port, cfg.metrics_host)
    stats = run_process(args, producer, stop, kafka, cfg.namespace, cfg.producer_id, metrics)
    progress(producer)  # the final counts
    result = {
        "producer_id": cfg.producer_id,
        "figures": {
            "episodes": sum(stats.finished.values()),
            "by_status": dict(stats.finished),
            "dropped_in_flight": stats.dropped,
            "sent": producer.writer.sent,
            "delivered": producer.writer.delivered,
            "delivery_failed": producer.writer.failed,
            "policy_version": producer.version,
            "paused_s": round(producer.paused_seconds(), 3),
            "connectors": connector_stats.snapshot(),
        },
    }
    print_result(args, result, f"producer {cfg.producer_id} done: {result['figures']}")
    return 0
