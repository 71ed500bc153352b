"""The trainer's device mesh: the same numbers whichever way a step is split.

A process's device count is fixed when JAX starts, so these run in a child process that
XLA gives four host devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

FOUR = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def _child(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=FOUR,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_ten_steps_on_every_mesh_of_four_devices_match_one_device() -> None:
    """1x1 against 4x1, 2x2 and 1x4 (fsdp x tensor) and against two processes of two
    devices, a Qwen2-shaped model with grouped-query attention, biases and an untied output
    layer, the default learning rate: parameters within 1e-5 after 10 steps."""
    result = json.loads(
        subprocess.run(
            [sys.executable, "-m", "pipeline.bench.scale", "10"],
            env=FOUR,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout.splitlines()[-1]
    )
    figures = result["figures"]
    assert figures["devices"] == 4
    for shape in ("4x1", "2x2", "1x4", "2p"):
        assert figures[f"{shape}.params_max_abs_diff"] <= 1e-5, (shape, figures)
    # two processes of two devices: the step split into its parts
    assert figures["2p.members"] == 2
    assert 0 < figures["2p.agree_s"] + figures["2p.data_s"] < figures["2p.step_s"]


def test_layers_are_split_by_kind_and_what_does_not_divide_stays_whole() -> None:
    specs = json.loads(
        _child(
            """
            import json, jax
            from pipeline.policy.config import ModelConfig
            from pipeline.policy.model import init_model
            from pipeline.train.config import GRPOConfig
            from pipeline.train.grpo import init_state
            from pipeline.train.mesh import make_mesh, state_shardings
            cfg = ModelConfig(family="qwen2", vocab_size=271, num_kv_heads=2, d_ff=96,
                              tie_embeddings=False)
            _, state = init_state(init_model(cfg), GRPOConfig().optimizer(), reference=False)
            sharded = jax.device_put(state, state_shardings(state, make_mesh(2, 2)))
            out = {}
            for path, leaf in jax.tree_util.tree_leaves_with_path(sharded):
                key = jax.tree_util.keystr(path)
                if "[0]" in key or "embed" in key or "lm_head" in key or "count" in key:
                    shard = leaf.addressable_shards[0].data.shape
                    out[key] = [str(leaf.sharding.spec), list(shard)]
            print(json.dumps(out))
            """
        )
    )
    p = ".params['blocks'][0]"
    assert specs[p + "['q']['kernel'].value"] == ["P('fsdp', 'tensor')", [64, 64]]
    assert specs[p + "['q']['bias'].value"] == ["P('tensor',)", [64]]
    assert specs[p + "['out']['kernel'].value"] == ["P('tensor', 'fsdp')", [64, 64]]
    assert specs[p + "['down']['kernel'].value"] == ["P('tensor', 'fsdp')", [48, 64]]
    assert specs[p + "['norm1']['scale'].value"][1] == [128]  # replicated
    # a vocabulary of 271 does not split over 2: that dimension stays whole
    assert specs[".params['embed']['embedding'].value"] == ["P(None, 'fsdp')", [271, 64]]
    assert specs[".params['lm_head']['kernel'].value"] == ["P('fsdp', None)", [64, 271]]
    mu = ".opt_state[1][0].mu['embed']['embedding'].value"
    assert specs[mu] == specs[".params['embed']['embedding'].value"]  # Adam follows


def test_a_mesh_larger_than_the_process_is_refused() -> None:
    from pipeline.errors import InvalidConfigError
    from pipeline.train.mesh import make_mesh

    with pytest.raises(InvalidConfigError, match="needs 8 devices; this process has 1"):
        make_mesh(4, 2)
