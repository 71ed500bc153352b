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
counted in median decode steps. ``--model`` takes a preset (tiny, small, base) or a
Hugging Face checkpoint directory (its shape: the weights are random); ``--swap-kv
recompute`` makes the producer recompute the key-value rows of the episodes in flight at
each swap (the first step after it prefills them all again).

Two producers run side by side: one reads each version from the publisher's folder, the
other (``weights_source: cluster``) from the copy sent through Kafka, as a producer on
another machine does; the publisher sends every version's files to ``<ns>.weights-data``
before announcing it, as the trainer does. After the full checkpoints, the last one is
read three ways in turn, for the throughput of each path: its files from disk, the same
bytes through a loopback TCP socket, and its chunks from the cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
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
from pipeline.kafka.weights_data import fetch_checkpoint, send_checkpoint
from pipeline.launch.cluster import Cluster
from pipeline.policy.checkpoint import file_chunks, save_params
from pipeline.policy.config import LoRAConfig, ModelConfig
from pipeline.policy.lora import init_adapters, save_adapters
from pipeline.policy.model import init_model
from pipeline.policy.server import PolicyServer
from pipeline.policy.tokenizer import tokenizer_for
from pipeline.rollout.config import AdmissionConfig, EpisodeLimits, ProducerConfig
from pipeline.rollout.producer import RolloutProducer

#: how each producer of the bench reads the weights
SOURCES = ("directory", "cluster")


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    model_cfg = ModelConfig.from_name(args.model or "tiny")
    lora = LoRAConfig(rank=args.lora_rank)
    n = args.announcements
    tokenizer_id = tokenizer_for(model_cfg.path).id  # a checkpoint directory's own
    with cluster as kafka, tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ns = f"benchweights{uuid.uuid4().hex[:8]}"
        ensure_topics(kafka, namespace_topics(ns, ["guess"], 4))
        cfg = ProducerConfig(
            namespace=ns,
            env="guess",
            env_options={"latency": LatencyModel(0.05, 1.0)},
            concurrency=args.concurrency or 64,
            model=model_cfg,
            limits=EpisodeLimits(max_new_tokens=8),
            checkpoint_roots=(root,),
            admission=AdmissionConfig(max_staleness=-1),
            swap_kv=args.swap_kv,
        )
        producers = {
            source: RolloutProducer(
                dataclasses.replace(cfg, weights_source=source, producer_id=f"bench-{source}"),
                kafka,
            )
            for source in SOURCES
        }
        threads = [threading.Thread(target=p.run, daemon=True) for p in producers.values()]
        for th in threads:
            th.start()
        while any(p.writer.sent < 32 for p in producers.values()):
            time.sleep(0.05)
        publisher = kafka.producer()
        data = kafka.producer(**{"compression.type": "none"})  # as the trainer sends
        created: dict[int, float] = {}
        sizes: dict[str, list[int]] = {"full": [], "adapters": []}
        save_s: dict[str, list[float]] = {"full": [], "adapters": []}
        send_s: list[float] = []
        base = save_params(root / "base", init_model(model_cfg, seed=0), 0)
        base_bytes = _bytes(base)
        base_digest, base_transfer = send_checkpoint(data, ns, base, 0, key="base")
        last_full: tuple[Path, dict[str, Any]] | None = None
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
            t0 = time.perf_counter()
            files_digest, transfer = send_checkpoint(data, ns, path, version)
            send_s.append(time.perf_counter() - t0)
            record = announcement(
                version, version, path, model_cfg, tokenizer_id, "bench", None, files_digest
            )
            record["format"] = "orbax" if kind == "full" else "orbax-lora"
            record["transfer"] = transfer
            record["base_transfer"] = base_transfer if kind == "adapters" else None
            created[version] = record["created_at_ms"] / 1000
            announce(publisher, ns, record)
            time.sleep(args.interval)
            if version == n:  # read back before adapters overwrite its chunks
                last_full = (path, transfer)
        deadline = time.monotonic() + 60 + 2 * n * max(send_s)
        while any(p.version < 2 * n for p in producers.values()):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for p in producers.values():
            p.stop()
        for th in threads:
            th.join(120)
        assert last_full is not None
        throughput = _throughputs(kafka, ns, root, *last_full, n)
    each = {source: _swaps(p, created, n) for source, p in producers.items()}
    ours, theirs = each["directory"], each["cluster"]
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
            **ours,
            **{f"cluster_{k}": v for k, v in theirs.items()},
            "full_bytes": full_bytes,
            "adapter_bytes": adapter_bytes,
            "base_bytes": base_bytes,
            "full_save_s_p50": statistics.median(save_s["full"]),
            "adapters_save_s_p50": statistics.median(save_s["adapters"]),
            "send_s_p50": statistics.median(send_s),
            **throughput,
            "swap_kv": args.swap_kv,
        },
        "ratios": {
            "full_vs_adapter_bytes": full_bytes / max(adapter_bytes, 1),
            "full_vs_adapter_propagation": ours["propagation_p50_s"]
            / max(ours["adapters_propagation_p50_s"], 1e-9),
            "cluster_vs_directory_propagation": theirs["propagation_p50_s"]
            / max(ours["propagation_p50_s"], 1e-9),
            "cluster_vs_loopback_throughput": throughput["cluster_fetch_gbps"]
            / max(throughput["loopback_gbps"], 1e-12),
        },
        "goals": {
            "propagation_p50_s": "< 1",
            "propagation_p99_s": "< 3",
            "cluster_propagation_p50_s": "<= 2 (0.5B shape)",
            "cluster_vs_loopback_throughput": ">= 0.5",
            "swap_stall_ms_p50": "<= 50",
        },
    }


def _swaps(producer: RolloutProducer, created: dict[int, float], n: int) -> dict[str, Any]:
    """One producer's propagation and swap-stall figures."""
    server = producer.server
    assert isinstance(server, PolicyServer)  # the bench's producers sample with the engine
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
    moved = [seen[v] for v in range(n + 2, 2 * n + 1) if v in seen]
    if not full or not moved:
        refused = dict(producer.weights.refused) if producer.weights else {}
        raise RuntimeError(
            f"announcements did not reach the producer {producer.cfg.producer_id}: "
            f"{sorted(seen)} (refused: {refused})"
        )
    stall_p50, stall_p99 = (float(x) for x in np.percentile(list(stalls.values()), [50, 99]))
    return {
        "applied": len(seen),
        # versions never applied (a newer one came first): not in the percentiles
        "skipped": 2 * n - len(seen),
        # applied while the policy was idle: in the propagation percentiles (the version
        # was in place from then), not in the stalls
        "applied_while_idle": idle,
        "propagation_p50_s": float(np.percentile(full, 50)),
        "propagation_p99_s": float(np.percentile(full, 99)),
        "adapters_propagation_p50_s": float(np.percentile(moved, 50)),
        "adapters_propagation_p99_s": float(np.percentile(moved, 99)),
        "adapters_first_propagation_s": seen.get(n + 1),
        "swap_stall_ms_p50": 1000 * stall_p50,
        "swap_stall_ms_p99": 1000 * stall_p99,
        "swap_stall_ms_max": 1000 * max(stalls.values()),
        "swap_stall_steps_p50": stall_p50 / median_step,
        "swap_stall_steps_p99": stall_p99 / median_step,
        "decode_step_ms_p50": 1000 * median_step,
    }


def _throughputs(
    kafka: Any, ns: str, root: Path, path: Path, transfer: dict[str, Any], version: int
) -> dict[str, float]:
    """GB/s of reading the checkpoint at ``path`` from disk, of its bytes through a
    loopback TCP socket, and of fetching its chunks from the cluster."""
    size = _bytes(path)
    t0 = time.perf_counter()
    for _ in file_chunks(path, size=4 << 20):
        pass
    disk_s = time.perf_counter() - t0
    loopback_s = _loopback_s(size)
    t0 = time.perf_counter()
    fetch_checkpoint(kafka, ns, transfer, version, root / "fetched")
    fetch_s = time.perf_counter() - t0
    return {
        "disk_read_gbps": size / disk_s / 1e9,
        "loopback_gbps": size / loopback_s / 1e9,
        "cluster_fetch_gbps": size / fetch_s / 1e9,
    }


def _loopback_s(size: int) -> float:
    """Seconds to carry ``size`` bytes through a TCP connection on 127.0.0.1."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    got = [0]

    def drain() -> None:
        conn, _ = server.accept()
        with conn:
            while chunk := conn.recv(1 << 20):
                got[0] += len(chunk)

    th = threading.Thread(target=drain, daemon=True)
    th.start()
    block = bytes(4 << 20)
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        sent = 0
        while sent < size:
            c.sendall(block[: min(len(block), size - sent)])
            sent += min(len(block), size - sent)
    th.join(60)
    elapsed = time.perf_counter() - t0
    server.close()
    assert got[0] == size
    return elapsed


def _moved(adapters: dict[str, Any], seed: int) -> dict[str, Any]:
    """Adapters that change the policy (fresh ones have B = 0)."""
    rng = np.random.default_rng(seed)
    return {
        k: {"a": v["a"], "b": rng.normal(0, 0.02, v["b"].shape).astype(np.float32)}
        for k, v in adapters.items()
    }
