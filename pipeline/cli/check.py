"""``rlstream check``: synthetic trajectories round-trip through Kafka, each checked.

Creates the namespace's topics, produces synthetic 4,096-token trajectories through the
real producer path (codec, headers, idempotent producer), consumes them as a consumer
group, decodes every one and checks that what arrived is exactly what was sent.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from pipeline.cli.common import (
    add_broker_args,
    add_json_arg,
    add_kafka_args,
    add_namespace_arg,
    cluster,
    print_result,
)
from pipeline.kafka.topics import ensure_topics, namespace_topics, rollout_topic
from pipeline.kafka.transport import Rejected, TrajectoryReader, TrajectoryWriter
from pipeline.launch.stop import process_flag
from pipeline.testing import make_trajectory


def register(sub: Any) -> None:
    p = sub.add_parser(
        "check",
        help="an end-to-end round trip of synthetic trajectories through Kafka, each "
        "checked on arrival",
    )
    add_namespace_arg(p)
    p.add_argument("--trajectories", type=int, default=2000, help="how many to send")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per trajectory")
    p.add_argument("--partitions", type=int, default=4, help="partitions of the test topic")
    add_kafka_args(p)
    add_broker_args(p)
    add_json_arg(p)
    p.set_defaults(func=cmd_check)


ENV = "synthetic"


def cmd_check(args: argparse.Namespace) -> int:
    stop = process_flag()
    with cluster(args) as kafka:
        ensure_topics(kafka, namespace_topics(args.namespace, [ENV], args.partitions))
        rng = np.random.default_rng(0)
        run_id = f"{int(time.time())}"
        writer = TrajectoryWriter(kafka, args.namespace)
        reader = TrajectoryReader(
            kafka, [rollout_topic(args.namespace, ENV)], f"{args.namespace}.smoke.{run_id}"
        )
        sent: dict[str, float] = {}
        t0 = time.perf_counter()
        for i in range(args.trajectories):
            if stop:
                break
            t = make_trajectory(
                args.tokens,
                rng=rng,
                env=ENV,
                group_id=f"{run_id}-{i // 8}",
                group_size=8,
                group_index=i % 8,
                reward=float(i),
            )
            writer.write(t)
            sent[t.trajectory_id] = t.reward
            if (i + 1) % 500 == 0:
                print(f"produced {i + 1}/{args.trajectories}", flush=True)
        writer.flush()
        produce_s = time.perf_counter() - t0
        received: dict[str, float] = {}
        rejected = 0
        deadline = time.monotonic() + 120
        while len(received) < len(sent) and time.monotonic() < deadline and not stop:
            for r in reader.poll_batch(512):
                if isinstance(r, Rejected):
                    rejected += 1
                elif r.trajectory.trajectory_id in sent:  # skip earlier runs' records
                    received[r.trajectory.trajectory_id] = r.trajectory.reward
        consume_s = time.perf_counter() - t0
        reader.close()
    ok = received == sent and rejected == 0
    mb = writer.bytes / 1e6
    result = {
        "ok": ok,
        "figures": {
            "sent": len(sent),
            "received": len(received),
            "rejected": rejected,
            "megabytes": round(mb, 2),
            "produce_trajectories_per_s": round(len(sent) / produce_s, 1),
            "end_to_end_s": round(consume_s, 2),
        },
    }
    text = (
        f"round trip {'OK' if ok else 'FAILED'}: sent={len(sent)} received={len(received)} "
        f"rejected={rejected} size={mb:.1f}MB produce={len(sent) / produce_s:.0f}/s "
        f"end_to_end={consume_s:.1f}s"
    )
    print_result(args, result, text)
    if not ok:
        print("rlstream run: records were lost, changed or rejected", file=sys.stderr)
    return 0 if ok else 1
