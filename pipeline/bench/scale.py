"""``rlstream bench scale``: the train step over device meshes, against one device.

The same GRPO steps (same initial parameters, same batches) run on one device and on
meshes of every shape over the process's devices (``fsdp x tensor``: 4x1, 2x2, 1x4 on four
devices); reported are each mesh's seconds per step and the largest absolute difference
of its parameters from one device's after the last step. On a CPU with fewer than four
devices the measurement runs in a child process that XLA gives four host devices
(``--xla_force_host_platform_device_count=4``): two cores cannot show a speed-up, so
there it shows that the numbers are the same whichever way the step is split, and what
the split costs.

Then the same steps run as a trainer group of two processes of two devices each (one
``jax.distributed`` job, gloo collectives on CPU, each process feeding its half of every
batch), split per step into ``data`` (building the global batch from each process's rows),
``agree`` (the members' agreement before a step) and ``compute`` (the SPMD step itself),
with ``collectives`` estimated as that step's time less the same mesh's inside one process.

Run as a module (``python -m pipeline.bench.scale``) it prints the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import jax
import numpy as np

from pipeline.policy.config import ModelConfig
from pipeline.policy.model import init_model
from pipeline.train.config import GRPOConfig
from pipeline.train.grpo import init_state, make_train_step
from pipeline.train.mesh import batch_sharding, make_mesh, state_shardings
from pipeline.train.objective import Batch

DEVICES = 4
#: a Qwen2-shaped model small enough for CPUs: grouped-query attention, biases, SwiGLU,
#: an untied output layer
MODEL = ModelConfig(
    family="qwen2",
    vocab_size=512,
    d_model=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    d_ff=128,
    max_len=128,
    tie_embeddings=False,
)


def _batches(cfg: ModelConfig, n: int, rows: int, length: int) -> list[Batch]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        mask = np.ones((rows, length), np.float32)
        mask[:, : length // 4] = 0
        out.append(
            Batch(
                rng.integers(0, cfg.vocab_size, (rows, length)).astype(np.int32),
                mask,
                np.full((rows, length), -6.0, np.float32),
                rng.standard_normal(rows).astype(np.float32),
                np.ones(rows, np.float32),
            )
        )
    return out


def train(
    cfg: ModelConfig, fsdp: int, tensor: int, batches: list[Batch]
) -> tuple[list[np.ndarray], float]:
    """Parameters after training on ``batches`` over an ``fsdp x tensor`` mesh, and the
    mean seconds of a step after the first."""
    grpo = GRPOConfig(warmup_steps=1)  # the default learning rate, 1e-3
    tx = grpo.optimizer()
    mesh = make_mesh(fsdp, tensor)
    graphdef, state = init_state(init_model(cfg, seed=0), tx, reference=False)
    shardings = state_shardings(state, mesh)
    state = jax.device_put(state, shardings)
    step = make_train_step(graphdef, grpo, tx, True, (shardings, batch_sharding(mesh)))
    times = []
    for b in batches:
        t0 = time.perf_counter()
        state, metrics = step(state, b)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    params = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    return params, float(np.mean(times[1:]))


def member(index: int, coordinator: str, steps: int, out: str, rows: int = 16) -> None:
    """Member ``index`` of a two-process group training ``steps`` batches (member 0 writes
    the parameters and its timings to ``out``)."""
    from pipeline.train.members import Members

    members = Members(2, index, coordinator)
    batches = _batches(MODEL, steps, rows, 64)
    grpo = GRPOConfig(warmup_steps=1)
    tx = grpo.optimizer()
    mesh = make_mesh(0, 1)
    graphdef, state = init_state(init_model(MODEL, seed=0), tx, reference=False)
    shardings = state_shardings(state, mesh)
    state = members.put(state, shardings)
    sharding = batch_sharding(mesh)
    step = make_train_step(graphdef, grpo, tx, True, (shardings, sharding))
    half = rows // 2
    times: dict[str, list[float]] = {"agree": [], "data": [], "compute": []}
    for b in batches:
        t0 = time.perf_counter()
        members.agree([1, 64])
        t1 = time.perf_counter()
        local = jax.tree.map(lambda x: np.asarray(x)[index * half : (index + 1) * half], b)
        batch = members.batch(local, sharding)
        t2 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        t3 = time.perf_counter()
        for k, v in (("agree", t1 - t0), ("data", t2 - t1), ("compute", t3 - t2)):
            times[k].append(v)
    params = members.host(state.params)
    if index == 0:
        np.savez(out, *[np.asarray(x) for x in jax.tree.leaves(params)])
        with open(out + ".json", "w") as f:
            json.dump({k: float(np.mean(v[1:])) for k, v in times.items()}, f)


def two_processes(steps: int) -> tuple[list[np.ndarray], dict[str, float]]:
    """Parameters and per-step seconds of a group of two processes of two devices."""
    import tempfile

    from pipeline.train.members import free_coordinator

    coordinator = free_coordinator()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "member0.npz")
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pipeline.bench.scale",
                    str(steps),
                    "--member",
                    str(i),
                    coordinator,
                    out,
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        errors = [p.communicate(timeout=600)[1] for p in procs]
        for p, err in zip(procs, errors, strict=True):
            if p.returncode != 0:
                raise RuntimeError(f"a member of the two-process group failed: {err[-2000:]}")
        with np.load(out) as z:
            params = [z[f"arr_{i}"] for i in range(len(z.files))]
        with open(out + ".json") as f:
            times: dict[str, float] = json.load(f)
    return params, times


def measure(steps: int = 6, rows: int = 16, length: int = 64) -> dict[str, Any]:
    n = jax.device_count()
    batches = _batches(MODEL, steps, rows, length)
    base, base_s = train(MODEL, 1, 1, batches)
    figures: dict[str, float] = {"members": 1.0, "devices": float(n), "1x1.step_s": base_s}
    worst = 0.0
    shapes = [(f, n // f) for f in range(n, 0, -1) if n % f == 0 and f * (n // f) > 1]
    for fsdp, tensor in shapes:
        params, step_s = train(MODEL, fsdp, tensor, batches)
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(params, base, strict=True))
        worst = max(worst, diff)
        figures[f"{fsdp}x{tensor}.step_s"] = step_s
        figures[f"{fsdp}x{tensor}.params_max_abs_diff"] = diff
        figures[f"{fsdp}x{tensor}.scaling_efficiency"] = base_s / (step_s * fsdp * tensor)
    if n == DEVICES and jax.default_backend() == "cpu":
        params, t = two_processes(steps)
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(params, base, strict=True))
        worst = max(worst, diff)
        step_s = t["agree"] + t["data"] + t["compute"]
        figures.update(
            {
                "2p.members": 2.0,
                "2p.step_s": step_s,
                "2p.compute_s": t["compute"],
                "2p.agree_s": t["agree"],
                "2p.data_s": t["data"],
                "2p.collectives_s": max(0.0, t["compute"] - figures[f"{n}x1.step_s"]),
                "2p.params_max_abs_diff": diff,
                "2p.scaling_efficiency": base_s / (step_s * n),
            }
        )
    figures["params_max_abs_diff"] = worst
    return {
        "bench": "scale",
        "device": jax.devices()[0].device_kind,
        "figures": figures,
        "goals": {"params within 1e-5 of one device": "met" if worst <= 1e-5 else "missed"},
    }


def run(args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    steps = args.steps or 6
    if jax.device_count() >= DEVICES or jax.default_backend() != "cpu":
        return measure(steps)
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
    ).strip()
    print(f"measuring in a child process with {DEVICES} host devices ...", flush=True)
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.bench.scale", str(steps)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the scale measurement failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "--member":
        member(int(sys.argv[3]), sys.argv[4], int(sys.argv[1]), sys.argv[5])
    else:
        print(json.dumps(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 6)))
