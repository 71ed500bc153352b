"""The CLI against the real broker: topics, the main job, benchmarks' output shape."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_broker import rlstream

pytestmark = pytest.mark.integration


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_topics_create_is_idempotent_and_describes(bootstrap: str, namespace: str) -> None:
    args = [
        "topics",
        "create",
        "--bootstrap",
        bootstrap,
        "--namespace",
        namespace,
        "--envs",
        "guess,calc",
        "--partitions",
        "3",
        "--json",
    ]
    first = rlstream(*args)
    assert first.returncode == 0, first.stderr
    topics = {t["name"]: t for t in last_json(first.stdout)["topics"]}
    assert set(topics) == {
        f"{namespace}.rollouts.guess",
        f"{namespace}.rollouts.calc",
        f"{namespace}.weights",
        f"{namespace}.weights-data",
        f"{namespace}.deadletter",
        f"{namespace}.telemetry",
        f"{namespace}.producers",
    }
    assert topics[f"{namespace}.rollouts.guess"]["partitions"] == 3
    assert topics[f"{namespace}.weights"]["config"]["cleanup.policy"] == "compact"
    assert topics[f"{namespace}.weights-data"]["config"]["cleanup.policy"] == "compact"
    assert "created" in first.stdout
    second = rlstream(*args)
    assert {t["action"] for t in last_json(second.stdout)["topics"]} == {"exists"}


def test_topics_list_describe_and_delete_a_namespace(bootstrap: str, namespace: str) -> None:
    where = ["--bootstrap", bootstrap, "--namespace", namespace, "--json"]
    assert rlstream("topics", "create", *where, "--envs", "guess").returncode == 0
    other = f"{namespace}x"  # a namespace whose name starts with this one's stays
    assert rlstream("topics", "create", *where[:3], other, "--envs", "guess").returncode == 0
    listed = last_json(rlstream("topics", "list", *where).stdout)["topics"]
    assert listed == sorted(
        f"{namespace}.{t}"
        for t in (
            "deadletter",
            "producers",
            "rollouts.guess",
            "telemetry",
            "weights",
            "weights-data",
        )
    )
    described = {
        t["name"]: t for t in last_json(rlstream("topics", "describe", *where).stdout)["topics"]
    }
    assert set(described) == set(listed)
    assert described[f"{namespace}.rollouts.guess"]["records"] == 0
    assert described[f"{namespace}.weights"]["config"]["cleanup.policy"] == "compact"
    refused = rlstream("topics", "delete", *where)
    assert refused.returncode == 2 and "add --yes" in refused.stderr
    assert last_json(rlstream("topics", "list", *where).stdout)["topics"] == listed
    deleted = rlstream("topics", "delete", *where, "--yes")
    assert deleted.returncode == 0 and last_json(deleted.stdout)["deleted"] == listed
    assert last_json(rlstream("topics", "list", *where).stdout)["topics"] == []
    assert (
        len(last_json(rlstream("topics", "list", *where[:3], other, "--json").stdout)["topics"])
        == 6
    )
    missing = rlstream("topics", "create", *where)
    assert missing.returncode == 2 and "--envs" in missing.stderr


def test_bad_namespace_is_a_clear_error(bootstrap: str) -> None:
    result = rlstream(
        "topics", "create", "--bootstrap", bootstrap, "--namespace", "a.b", "--envs", "x"
    )
    assert result.returncode == 2
    assert "namespace 'a.b'" in result.stderr


def test_check_round_trip(bootstrap: str, namespace: str) -> None:
    result = rlstream(
        "check",
        "--bootstrap",
        bootstrap,
        "--namespace",
        namespace,
        "--trajectories",
        "120",
        "--tokens",
        "512",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    out = last_json(result.stdout)
    assert out["ok"] is True
    assert out["figures"]["sent"] == out["figures"]["received"] == 120


def test_bench_codec_prints_ratios() -> None:
    result = rlstream(
        "bench", "codec", "--seconds", "0.05", "--rounds", "1", "--tokens", "256", "--json"
    )
    assert result.returncode == 0, result.stderr
    out = last_json(result.stdout)
    assert out["bench"] == "codec"
    assert set(out["ratios"]) == {
        "vs_fastavro_same_schema",
        "vs_pickle",
        "vs_avro_arrays",
        "vs_python",
        "vs_fastavro_same_schema_32_turns",
        "vs_pickle_32_turns",
        "vs_avro_arrays_32_turns",
        "vs_python_32_turns",
    }
    assert all(v > 0 for v in out["ratios"].values())
    assert out["figures"]["native"] is True  # the C codec, built at install


def test_bench_transport_runs_next_to_kafka_tools(bootstrap: str) -> None:
    result = rlstream(
        "bench",
        "transport",
        "--bootstrap",
        bootstrap,
        "--records",
        "200",
        "--tokens",
        "1024",
        "--rounds",
        "2",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    out = last_json(result.stdout)
    f = out["figures"]
    assert f["consumed"] == 200
    assert f["kafka_producer_perf_per_s"] > 0
    assert f["kafka_consumer_perf_per_s"] > 0
    assert out["ratios"]["vs_kafka_tools"] > 0
    # two interleaved rounds, each side's compressed bytes on the wire measured by Kafka
    assert all(len(v) == 2 for v in f["per_round"].values())
    for side in ("rlstream_produce", "kafka_producer_perf"):
        assert 0 < f[f"{side}_wire_mb_per_s"] < f[f"{side}_mb_per_s"]  # lz4 compressed them
    # the tool was given rlstream's records: they compress alike (within a fifth)
    ours = f["rlstream_produce_wire_mb_per_s"] / f["rlstream_produce_mb_per_s"]
    tool = f["kafka_producer_perf_wire_mb_per_s"] / f["kafka_producer_perf_mb_per_s"]
    assert abs(ours / tool - 1) < 0.2


def test_bench_telemetry_switches_the_tracer_of_a_running_producer(bootstrap: str) -> None:
    result = rlstream(
        "bench",
        "telemetry",
        "--bootstrap",
        bootstrap,
        "--seconds",
        "1",
        "--rounds",
        "2",
        "--concurrency",
        "16",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    f = last_json(result.stdout)["figures"]
    assert f["trajectories_per_s_off"] > 0 and f["trajectories_per_s_on"] > 0
    # spans were shipped while on, and the tracer's CPU time was measured
    assert f["spans_per_s"] > 0 and f["spans_per_trajectory"] > 1
    assert f["tracer_cpu_share"] == pytest.approx(f["record_cpu_share"] + f["flush_cpu_share"])
    # the measurement: the process's CPU per trajectory on over off, from the same windows
    on, off = f["cpu_per_trajectory_ms_on"], f["cpu_per_trajectory_ms_off"]
    assert on > 0 and off > 0
    assert f["telemetry_overhead_measured"] == pytest.approx(on / off - 1)
    assert f["overhead_pair_min"] <= f["overhead_pair_max"]
    assert f["flush_cpu_share"] > 0
    assert result.stdout.count("telemetry on") == result.stdout.count("telemetry off") == 2


def test_bench_weights_sends_full_weights_and_adapters_to_a_running_producer(
    bootstrap: str,
) -> None:
    result = rlstream(
        "bench",
        "weights",
        "--bootstrap",
        bootstrap,
        "--announcements",
        "2",
        "--interval",
        "1",
        "--swap-kv",
        "recompute",  # episodes in flight are prefilled again under each new version
        "--json",
    )
    assert result.returncode == 0, result.stderr
    out = last_json(result.stdout)
    f = out["figures"]
    assert f["applied"] == f["announcements"] == 4
    assert f["swap_kv"] == "recompute"
    assert 0 <= f["swap_stall_steps_p50"] <= f["swap_stall_steps_p99"]
    assert f["skipped"] == 0 and 0 <= f["applied_while_idle"] <= f["applied"]
    assert f["adapter_bytes"] < f["full_bytes"] <= f["base_bytes"] * 1.1
    assert f["adapters_first_propagation_s"] > 0 and f["adapters_propagation_p50_s"] > 0
    assert out["ratios"]["full_vs_adapter_bytes"] > 3
    # the producer that reads the cluster's copy got every version too
    assert f["cluster_applied"] == 4 and f["cluster_skipped"] == 0
    assert f["cluster_propagation_p50_s"] > 0 and f["cluster_adapters_first_propagation_s"] > 0
    assert min(f["disk_read_gbps"], f["loopback_gbps"], f["cluster_fetch_gbps"]) > 0
    assert out["ratios"]["cluster_vs_directory_propagation"] > 0
