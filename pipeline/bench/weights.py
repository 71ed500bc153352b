"""``rlstream bench weights``: how fast a new checkpoint reaches a running producer, and
how long generation stalls for the swap; full weights against LoRA adapters.

A producer runs 64 episodes against ``guess`` (50 ms median latency) with weight reload
on; a publisher saves a checkpoint and announces it every ``--interval`` seconds: first
``--announcements`` full checkpoints, then as many LoRA adapter checkpoints (rank
``--lora-rank`` on every linear layer) on one base, which the producer loads with the
first of them. For each announcement: propagation = the moment the policy thread first
samples with the new version minus the announcement's creation time (checkpoint already
durable); a swap applied while the policy was idle counts from when it was applied (and
is counted, ``applied_while_idle``); swap stall = the swap itself plus how much longer the
first decode step after it took than the median step (idle swaps stall nothing), also
counted in median decode steps. ``--model`` takes a preset (tiny, small, base);
``--swap-kv recompute`` makes the producer recompute the key-value rows of the episodes in
flight at each swap (the first step after it prefills them all again).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from connectors.base import LatencyModel
from pipeline.kafka.topics import ensure_topics, namespace_topics
from pipeline.kafka.weights import announce, announcement
from pipeline.launch.cluster import Cluster
from pipeline.policy.checkpoint import digest, save_params
from pipeline.policy.config import LoRAConfig, ModelConfig
from pipeline.policy.lora import init_adapters, save_adapters
from pipeline.policy.model import init_model
from pipeline.policy.server import PolicyServer
from pipeline.policy.tokenizer import TOKENIZER_ID
from pipeline.rollout.config import AdmissionConfig, EpisodeLimits, ProducerConfig
from pipeline.rollout.producer import RolloutProducer


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    model_cfg = ModelConfig.from_name(args.model or "tiny")
    lora = LoRAConfig(rank=args.lora_rank)
    n = args.announcements
    with cluster as kafka, tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ns = f"benchweights{uuid.uuid4().hex[:8]}"
        ensure_topics(kafka, namespace_topics(ns, ["guess"], 4))
        cfg = ProducerConfig(
            namespace=ns,
            env="guess",
            env_options={"latency": LatencyModel(0.05, 1.0)},
            concurrency=64,
            model=model_cfg,
            limits=EpisodeLimits(max_new_tokens=8),
            checkpoint_roots=(root,),
            admission=AdmissionConfig(max_staleness=-1),
            swap_kv=args.swap_kv,
        )
        producer = RolloutProducer(cfg, kafka)
        th = threading.Thread(target=producer.run, daemon=True)
        th.start()
        while producer.writer.sent < 32:
            time.sleep(0.05)
        publisher = kafka.producer()
        created: dict[int, float] = {}
        sizes: dict[str, list[int]] = {"full": [], "adapters": []}
        save_s: dict[str, list[float]] = {"full": [], "adapters": []}
        base = save_params(root / "base", init_model(model_cfg, seed=0), 0)
        base_digest, base_bytes = digest(base), _bytes(base)
        for version in range(1, 2 * n + 1):
            kind = "full" if version <= n else "adapters"
            path = root / f"v{version}"
            t0 = time.perf_counter()
            if kind == "full":
                save_params(path, init_model(model_cfg, seed=version), version)
            else:
                adapters = _moved(init_adapters(model_cfg, lora, version), version)
                save_adapters(path, adapters, version, model_cfg, lora, base, base_digest)
            save_s[kind].append(time.perf_counter() - t0)
            sizes[kind].append(_bytes(path))
            record = announcement(version, version, path, model_cfg, TOKENIZER_ID, "bench")
            record["format"] = "orbax" if kind == "full" else "orbax-lora"
            created[version] = record["created_at_ms"] / 1000
            announce(publisher, ns, record)
            time.sleep(args.interval)
        deadline = time.monotonic() + 60
        while producer.version < 2 * n and time.monotonic() < deadline:
            time.sleep(0.1)
        producer.stop()
        th.join(120)
    server = producer.server
    assert isinstance(server, PolicyServer)  # the bench's producer samples with its engine
    median_step = statistics.median(server.step_s)
    seen = {v: at - created[v] for v, at, _, _ in server.swaps if v in created}
    # a swap applied while the policy was idle stalled no step: counted, not a stall
    stalls = {
        v: swap_s + max(0.0, first - median_step)
        for v, _, swap_s, first in server.swaps
        if first is not None
    }
    idle = sum(first is None for v, _, _, first in server.swaps if v in created)
    full = [seen[v] for v in range(1, n + 1) if v in seen]
    # the first adapters also bring the base; the others move only adapters
    first_adapters = seen.get(n + 1)
    moved = [seen[v] for v in range(n + 2, 2 * n + 1) if v in seen]
    if not full or not moved:
        raise RuntimeError(f"announcements did not reach the producer: {sorted(seen)}")
    stall_p50, stall_p99 = (float(x) for x in np.percentile(list(stalls.values()), [50, 99]))
    full_p50 = float(np.percentile(full, 50))
    adapters_p50 = float(np.percentile(moved, 50))
    full_bytes, adapter_bytes = (
        statistics.median(sizes["full"]),
        statistics.median(sizes["adapters"]),
    )
    return {
        "bench": "weights",
        "figures": {
            "model_params": model_cfg.num_params(),
            "lora_rank": lora.rank,
            "announcements": 2 * n,
            "applied": len(seen),
            # versions never applied (a newer one came first): not in the percentiles
            "skipped": 2 * n - len(seen),
            # applied while the policy was idle: in the propagation percentiles (the
            # version was in place from then), not in the stalls
            "applied_while_idle": idle,
            "propagation_p50_s": full_p50,
            "propagation_p99_s": float(np.percentile(full, 99)),
            "adapters_propagation_p50_s": adapters_p50,
            "adapters_propagation_p99_s": float(np.percentile(moved, 99)),
            "adapters_first_propagation_s": first_adapters,
            "full_bytes": full_bytes,
            "adapter_bytes": adapter_bytes,
            "base_bytes": base_bytes,
            "full_save_s_p50": statistics.median(save_s["full"]),
            "adapters_save_s_p50": statistics.median(save_s["adapters"]),
            "swap_kv": args.swap_kv,
            "swap_stall_ms_p50": 1000 * stall_p50,
            "swap_stall_ms_p99": 1000 * stall_p99,
            "swap_stall_ms_max": 1000 * max(stalls.values()),
            "swap_stall_steps_p50": stall_p50 / median_step,
            "swap_stall_steps_p99": stall_p99 / median_step,
            "decode_step_ms_p50": 1000 * median_step,
        },
        "ratios": {
            "full_vs_adapter_bytes": full_bytes / max(adapter_bytes, 1),
            "full_vs_adapter_propagation": full_p50 / max(adapters_p50, 1e-9),
        },
        "goals": {
            "propagation_p50_s": "< 1",
            "propagation_p99_s": "< 3",
            "swap_stall_ms_p50": "<= 50",
        },
    }


def _moved(adapters: dict[str, Any], seed: int) -> dict[str, Any]:
    """Adapters that change the policy (fresh ones have B = 0)."""
    rng = np.random.default_rng(seed)
    return {
        k: {"a": v["a"], "b": rng.normal(0, 0.02, v["b"].shape).astype(np.float32)}
        for k, v in adapters.items()
    }
