"""Producers that sample with an inference server (``--policy openai:URL``) against the
real llama.cpp server (``llama-server`` in router mode, built by infra/llama-server.sh) and
the real broker: token ids and log-probabilities exactly the server's model's, versions
the server confirmed, full weights and LoRA adapters reaching it, and a server killed in
the middle of episodes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipeline.kafka.client import KafkaConfig
from pipeline.kafka.topics import ensure_topics, namespace_topics, rollout_topic
from pipeline.kafka.transport import Decoded, TrajectoryReader
from pipeline.kafka.weights import announce, announcement
from pipeline.policy.checkpoint import digest, save_params
from pipeline.policy.config import LoRAConfig, ModelConfig
from pipeline.policy.hf_init import init_checkpoint
from pipeline.policy.hf_weights import initial_model
from pipeline.policy.lora import init_adapters, merged, save_adapters
from pipeline.policy.model import init_model, token_logprobs
from pipeline.policy.tokenizer import tokenizer_for
from pipeline.records.trajectory import Trajectory
from pipeline.rollout.config import AdmissionConfig, EpisodeLimits, ProducerConfig
from pipeline.rollout.producer import RolloutProducer
from pipeline.rollout.status import status_line
from tests.integration.test_producer import run_in_thread, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.llama_server]

ROOT = Path(__file__).resolve().parents[2]


def server_binary() -> Path:
    failed = os.environ.get("RLSTREAM_LLAMA_SERVER_FAILED")
    if failed:
        pytest.fail(f"llama.cpp's server is not built: {failed}")
    given = os.environ.get("RLSTREAM_LLAMA_SERVER")
    path = Path(given) if given else ROOT / "infra" / "llama.cpp" / "bin" / "llama-server"
    if not path.is_file():
        pytest.fail(f"llama.cpp's server is not built at {path}: run infra/llama-server.sh")
    return path


class Router:
    """llama-server in router mode over a models folder, on a port of its own."""

    def __init__(self, models: Path, log: Path) -> None:
        self.models = models
        self.log = log
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Router:
        self.proc = subprocess.Popen(
            [
                str(server_binary()),
                "--models-dir",
                str(self.models),
                "--models-max",
                "2",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--ctx-size",
                "8192",
                "--parallel",
                "8",
                "--threads",
                "1",
                # float32 keys and values (llama.cpp's default is float16): the server's
                # log-probabilities are then the model's to float32 rounding
                "--cache-type-k",
                "f32",
                "--cache-type-v",
                "f32",
                "--flash-attn",
                "off",
            ],
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its model instances are its children: one group
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"llama-server did not answer: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def models_listed(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/models", timeout=5) as r:
            return json.loads(r.read())["data"]  # type: ignore[no-any-return]


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return init_checkpoint(tmp_path / "model", "qwen2", "tiny", seed=0)


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Router]:
    models = tmp_path / "models"
    models.mkdir()
    r = Router(models, tmp_path / "llama-server.log").start()
    try:
        yield r
    finally:
        r.kill()


def producer_config(
    namespace: str, router: Router, checkpoint: Path, **kw: object
) -> ProducerConfig:
    base: dict[str, object] = dict(
        namespace=namespace,
        env="guess",
        concurrency=8,
        group_size=4,
        model=ModelConfig.from_name(str(checkpoint)),
        limits=EpisodeLimits(max_new_tokens=8),
        admission=AdmissionConfig(max_staleness=-1),
        policy=f"openai:{router.url}",
        policy_models_dir=router.models,
        policy_wait_s=30.0,
    )
    base.update(kw)
    return ProducerConfig(**base)  # type: ignore[arg-type]


def read_all(kafka: KafkaConfig, namespace: str, count: int) -> list[Trajectory]:
    reader = TrajectoryReader(kafka, [rollout_topic(namespace, "guess")], f"{namespace}.check")
    got = reader.read(count, timeout=60)
    reader.close()
    assert all(isinstance(r, Decoded) for r in got)
    return [r.trajectory for r in got]  # type: ignore[union-attr]


def check_sampled_by(t: Trajectory, version: int, model: nnx.Module) -> int:
    """The tokens ``version`` sampled in ``t`` carry ``model``'s log-probabilities (the
    server's float32 arithmetic beside JAX's); how many were checked."""
    full = np.asarray(token_logprobs(model, jnp.asarray([t.tokens.tolist()]))[0])  # type: ignore[arg-type]
    checked = 0
    for span in t.version_spans:
        if span.version == version:
            idx = [i for i in range(span.start, span.end) if t.loss_mask[i]]
            np.testing.assert_allclose(t.logprobs[idx], full[idx], atol=2e-3, err_msg=f"v{version}")
            checked += len(idx)
    return checked


def test_a_producer_samples_with_llama_cpp_and_records_the_versions_it_confirmed(
    kafka: KafkaConfig, namespace: str, tmp_path: Path, checkpoint: Path, router: Router
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 1))
    cfg = producer_config(namespace, router, checkpoint, checkpoint_roots=(tmp_path,))
    producer = RolloutProducer(cfg, kafka)
    assert (router.models / f"{namespace}-v0.gguf").is_file()  # the server starts at version 0
    th = run_in_thread(producer)
    wait_for(lambda: producer.writer.sent >= 8)

    # full weights: version 3, another random initialization of the same shape
    model_cfg = cfg.model
    v3 = init_model(model_cfg, seed=42)
    base = save_params(tmp_path / "v3", v3, 3)
    p = kafka.producer()
    announce(p, namespace, announcement(3, 3, base, model_cfg, producer.tokenizer.id, "trainer"))
    wait_for(lambda: producer.version == 3, 120)
    sent = producer.writer.sent
    wait_for(lambda: producer.writer.sent >= sent + 8, 120)

    # LoRA adapters on that base: version 4 reaches the server merged
    lora = LoRAConfig(rank=2, alpha=4.0)
    rng = np.random.default_rng(4)
    adapters = {
        k: {"a": v["a"], "b": rng.normal(0, 0.5, v["b"].shape).astype(np.float32)}
        for k, v in init_adapters(model_cfg, lora, 4).items()
    }
    path = save_adapters(tmp_path / "v4", adapters, 4, model_cfg, lora, base, digest(base))
    record = announcement(4, 4, path, model_cfg, producer.tokenizer.id, "trainer")
    record["format"] = "orbax-lora"
    announce(p, namespace, record)
    wait_for(lambda: producer.version == 4, 120)
    sent = producer.writer.sent
    wait_for(lambda: producer.writer.sent >= sent + 8, 120)
    producer.stop()
    th.join(60)
    assert producer.weights is not None and producer.weights.accepted == 2, producer.weights.refused
    line = status_line(producer)
    assert line["server_turns"] > 0 and line["server_failures"] == {}
    assert line["version"] == 4
    loaded = {m["id"] for m in router.models_listed()}
    assert {f"{namespace}-v3", f"{namespace}-v4"} <= loaded

    records = read_all(kafka, namespace, producer.writer.sent)
    assert {t.status for t in records} <= {"ok", "truncated"}
    graphdef, params = nnx.split(v3)
    v4 = nnx.merge(graphdef, merged(params, adapters, lora.scale))
    models = {0: initial_model(model_cfg), 3: v3, 4: v4}
    checked = dict.fromkeys(models, 0)
    for version, model in models.items():  # the last three records of each version
        having = [t for t in records if version in {s.version for s in t.version_spans}]
        for t in having[-3:]:
            checked[version] += check_sampled_by(t, version, model)
    assert all(checked.values()), checked
    # the adapters changed what the server computes
    t4 = next(t for t in records if t.max_version == 4)
    full3 = np.asarray(token_logprobs(v3, jnp.asarray([t4.tokens.tolist()]))[0])
    assert np.abs(full3[t4.loss_mask > 0] - t4.logprobs[t4.loss_mask > 0]).max() > 1e-2
    # every record's tokens render back to the conversation the tokenizer would build
    tok = tokenizer_for(str(checkpoint))
    assert all(tok.decode(t.tokens.tolist()) for t in records)


def test_a_server_killed_mid_episode_ends_those_episodes_with_a_reason_and_the_producer_recovers(
    kafka: KafkaConfig, namespace: str, tmp_path: Path, checkpoint: Path, router: Router
) -> None:
    ensure_topics(kafka, namespace_topics(namespace, ["guess"], 1))
    cfg = producer_config(
        namespace,
        router,
        checkpoint,
        checkpoint_roots=(tmp_path,),
        limits=EpisodeLimits(max_new_tokens=64, max_policy_turns=8),
    )
    producer = RolloutProducer(cfg, kafka)
    th = run_in_thread(producer)
    wait_for(lambda: producer.writer.sent >= 4)
    assert isinstance(producer.server, object)
    turns = producer.server.turns  # type: ignore[attr-defined]
    wait_for(lambda: producer.server.turns > turns)  # type: ignore[attr-defined]
    router.kill()  # turns in flight are cut
    wait_for(lambda: producer.stats.finished["env_error"] > 0, 60)
    failures = dict(producer.server.failures)  # type: ignore[attr-defined]
    assert failures.get("turn dropped", 0) + failures.get("unreachable", 0) > 0, failures
    assert th.is_alive()
    time.sleep(1.0)  # new turns wait for the server meanwhile
    router.start()
    ok_before = producer.stats.finished["ok"] + producer.stats.finished["truncated"]
    wait_for(
        lambda: (
            producer.stats.finished["ok"] + producer.stats.finished["truncated"] >= ok_before + 8
        ),
        120,
    )
    producer.stop()
    th.join(60)
    assert not th.is_alive()
    assert producer.failure is None
    records = read_all(kafka, namespace, producer.writer.sent)
    failed = [t for t in records if t.status == "env_error"]
    assert failed and all(t.reward == 0.0 for t in failed)
    good = [t for t in records if t.status in ("ok", "truncated")]
    model = initial_model(cfg.model)
    assert sum(check_sampled_by(t, 0, model) for t in good[-4:]) > 0
