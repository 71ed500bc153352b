"""The worst inputs at every boundary, without a broker: records, the training step,
checkpoint directories, model configurations, the remote environment protocol, the
environment server and episodes. (Through a real broker: tests/integration/
test_hostile_records.py.)"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from connectors import protocol
from connectors.base import Environment, Step, Task
from connectors.serve import HostError, SessionHost, http_app
from pipeline.errors import InvalidConfigError, RecordDecodeError
from pipeline.policy.checkpoint import digest, find_weights, save_params, saved_version, snapshot
from pipeline.policy.config import ModelConfig
from pipeline.policy.model import all_finite, init_model
from pipeline.policy.tokenizer import ByteTokenizer
from pipeline.records.codec import TrajectoryCodec, to_avro_dict
from pipeline.rollout.config import EpisodeLimits
from pipeline.rollout.episode import GroupSlot, run_episode
from pipeline.testing import ScriptedPolicy, group_member, make_trajectory
from pipeline.train.config import GRPOConfig
from pipeline.train.contract import RecordContract
from pipeline.train.grpo import init_state, make_train_step
from pipeline.train.objective import Batch

CODEC = TrajectoryCodec()
TOK = ByteTokenizer()
CFG = ModelConfig(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=64)


def mutated(change: Any, **kw: Any) -> bytes:
    d = copy.deepcopy(to_avro_dict(make_trajectory(40, turns=2, **kw)))
    change(d)
    return CODEC.encode_avro_dict(d)


# ---- records ---------------------------------------------------------------------------


def test_a_tensor_whose_shape_overflows_is_refused_not_a_numpy_error() -> None:
    for shape in ([2**62, 0], [0, 2**62], [2**31, 2**31, 0], [-1, 0], [1] * 9):

        def change(d: dict[str, Any], shape: list[int] = shape) -> None:
            d["tokens"] = {"dtype": "int32", "shape": shape, "data": b""}

        with pytest.raises(RecordDecodeError) as e:
            CODEC.decode(mutated(change))
        assert e.value.reason == "tensor_mismatch", shape


def test_the_training_contract_refuses_each_kind_with_its_reason() -> None:
    contract = RecordContract(vocab_size=272)
    ok = make_trajectory(40, turns=2, versions=(3,))
    assert contract.violation(ok, newest_version=3) is None
    policy = int(np.flatnonzero(ok.loss_mask)[0])

    def variant(**fields: Any) -> Any:
        t = copy.copy(ok)
        for k, v in fields.items():
            setattr(t, k, v)
        return t

    def array(name: str, index: int, value: Any) -> np.ndarray:
        a = getattr(ok, name).copy()
        a[index] = value
        return a

    cases = {
        "token_range": [
            variant(tokens=array("tokens", 3, 100_000)),
            variant(tokens=array("tokens", 3, -1)),
            variant(tokens=array("tokens", 3, 272)),
        ],
        "bad_logprob": [
            variant(logprobs=array("logprobs", policy, 5.0)),
            variant(logprobs=array("logprobs", policy, -1e30)),
        ],
        "reward_bound": [variant(reward=1e308), variant(rewards={"a": -2e6})],
        "future_version": [ok],
    }
    for reason, ts in cases.items():
        for t in ts:
            newest = 2 if reason == "future_version" else 3
            found = contract.violation(t, newest)
            assert found is not None and found[0] == reason, (reason, found)
    assert contract.violation(ok, None) is None  # a recording: no bound on versions
    # a log-probability far below 0 on a token the policy did not write is no concern
    ctx = int(np.flatnonzero(ok.loss_mask == 0)[0])
    assert contract.violation(variant(logprobs=array("logprobs", ctx, -1e30)), 3) is None
    with pytest.raises(InvalidConfigError):
        RecordContract(vocab_size=272, max_abs_reward=float("inf"))


def test_a_record_whose_log_probabilities_were_taken_at_another_temperature_is_refused() -> None:
    from pipeline.kafka.message import Record
    from pipeline.records.trajectory import META_TEMPERATURE
    from pipeline.train.intake import RecordJudge

    def Message(temperature: str | None) -> Record:
        t = make_trajectory(40, turns=2, tokenizer_id=TOK.id)
        if temperature is not None:
            t.metadata = {**t.metadata, META_TEMPERATURE: temperature}
        return Record("ns.rollouts.math", 0, 0, 0, b"g", CODEC.encode(t))

    judge = RecordJudge(RecordContract(vocab_size=272), TOK.id, 1 << 20, temperature=0.7)

    def verdict(temperature: str | None) -> str:
        found = judge(Message(temperature), lambda version: False, None)
        return found.reason if isinstance(found, RecordDecodeError) else "trained"

    assert verdict(repr(0.7)) == verdict("0.7000000001") == "trained"
    assert verdict(None) == "trained"  # a writer that does not say: taken to be at 0.7
    for wrong in ("1.0", "0.69", "0", "nan", "inf", "-0.7", "", "0.7; drop table", "x" * 10_000):
        assert verdict(wrong) == "temperature", wrong
    refusal = judge(Message("1.0"), lambda version: False, None)
    assert isinstance(refusal, RecordDecodeError) and "grpo.temperature" in refusal.detail


def test_a_step_whose_loss_or_gradients_are_not_finite_changes_nothing() -> None:
    cfg = GRPOConfig(warmup_steps=1)
    tx = cfg.optimizer()
    graphdef, state = init_state(init_model(CFG, 0), tx)
    step = make_train_step(graphdef, cfg, tx)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 260, (4, 16)).astype(np.int32)
    mask = np.ones((4, 16), np.float32)
    good = Batch(tokens, mask, np.full((4, 16), -5.0, np.float32), np.ones(4), np.ones(4))
    state, m = step(state, good)
    assert float(m["applied"]) == 1.0 and int(state.step) == 1
    state, m = step(state, good)  # (past warm-up: a real update)
    before = state
    for bad in (
        good._replace(advantage=np.asarray([np.nan, 1, 1, 1], np.float32)),
        good._replace(tokens=np.where(tokens > 100, 100_000, tokens).astype(np.int32)),
    ):
        after, m = step(before, bad)
        assert float(m["applied"]) == 0.0
        assert int(after.step) == int(before.step)
        for a, b in zip(
            np.concatenate([np.ravel(x) for x in jax_leaves(after.params)]),
            np.concatenate([np.ravel(x) for x in jax_leaves(before.params)]),
            strict=True,
        ):
            assert a == b
    # extreme behaviour log-probabilities are trained without overflow (capped weights)
    for lp in (-1e30, -np.inf):
        extreme, m = step(before, good._replace(behaviour=np.full((4, 16), lp, np.float32)))
        assert float(m["applied"]) == 1.0 and all_finite(extreme.params)
        assert np.isfinite(float(m["is_weight_max"]))


def jax_leaves(tree: Any) -> list[np.ndarray]:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_unreadable_headers_and_unforeseen_failures_become_refusals(tmp_path: Path) -> None:
    from pipeline.train.config import TrainerConfig
    from pipeline.train.trainer import Trainer

    class Source:  # a recording stand-in: the trainer needs no broker to judge records
        exhausted = False

        def subscribe(self, topics: Any, on_assign: Any, on_revoke: Any) -> None:
            pass

    class Message:
        def __init__(self, offset: int, value: bytes, headers: Any = None) -> None:
            self._offset, self._value, self._headers = offset, value, headers

        def error(self) -> None:
            return None

        def topic(self) -> str:
            return "ns.rollouts.math"

        def partition(self) -> int:
            return 0

        def offset(self) -> int:
            return self._offset

        def timestamp(self) -> tuple[int, int]:
            return (0, 0)

        def key(self) -> bytes:
            return b"k"

        def value(self) -> bytes:
            return self._value

        def headers(self) -> Any:
            if isinstance(self._headers, BaseException):
                raise self._headers
            return self._headers

    cfg = TrainerConfig(namespace="ns", run_dir=tmp_path, buckets=(64,), model=CFG)
    trainer = Trainer(cfg, None, source=Source())
    good = CODEC.encode(make_trajectory(40, env="math", turns=2, tokenizer_id=TOK.id))
    trainer._intake(Message(0, good, SystemError("header name is not UTF-8")))
    # a codec failure nobody foresaw is still a refusal with a reason, never a crash
    trainer.judge.codec = None  # type: ignore[assignment]
    trainer._intake(Message(1, good))
    assert dict(trainer.drops) == {"bad_header": 1, "internal": 1}
    assert trainer.deadlettered == 2
    assert trainer.tracker.low(("ns.rollouts.math", 0)) == 2  # both settled


class _Intake:
    """A trainer without Kafka (a source that never delivers) fed records one by one
    through its intake, as members ``index`` of groups of four ``math`` trajectories."""

    def __init__(self, tmp_path: Path, seed: int, **settings: Any) -> None:
        from pipeline.train.config import TrainerConfig
        from pipeline.train.trainer import Trainer

        class Source:
            exhausted = False

            def subscribe(self, topics: Any, on_assign: Any, on_revoke: Any) -> None:
                pass

        cfg = TrainerConfig(
            namespace="ns", run_dir=tmp_path, buckets=(64,), model=CFG, group_size=4, **settings
        )
        self.trainer = Trainer(cfg, None, source=Source())
        self.rng = np.random.default_rng(seed)
        self.offset = iter(range(100))

    def send(self, gid: str, index: int, value: bytes | None = None, **kw: Any) -> None:
        from pipeline.kafka.message import Record

        data = CODEC.encode(group_member(gid, index, self.rng, **kw)) if value is None else value
        record = Record("ns.rollouts.math", 0, next(self.offset), 0, gid.encode(), data)
        self.trainer._intake(record)


def test_a_refused_member_releases_its_group_at_once(tmp_path: Path) -> None:
    """A group that lost a member to a refusal can never complete: its waiting members
    are dropped at once (``group_refused``), not held until ``group_timeout_s``, and so
    is every member that arrives after it; other groups are untouched."""
    intake = _Intake(tmp_path, 5, group_timeout_s=600)
    trainer, send = intake.trainer, intake.send
    for i in range(2):
        send("lost", i)
        send("sound", i)
    send("lost", 2, b"\xc3\x01 not a record")  # refused: the group can never complete
    assert trainer.drops["group_refused"] == 2  # its two waiting members, at once
    send("lost", 3)  # a member arriving later is dropped as well
    assert trainer.drops["group_refused"] == 3
    assert trainer.deadlettered == 1  # only the invalid record is a dead letter
    for i in range(2, 4):
        send("sound", i)
    assert len(trainer.ready) == 1  # the other group completed as usual
    tp = ("ns.rollouts.math", 0)  # lost's four records settled, sound's still to train
    assert [o for o in range(8) if trainer.tracker.is_settled(tp, o)] == [0, 2, 4, 5]
    assert "incomplete_group" not in trainer.drops


def test_a_partial_group_trains_at_its_deadline_and_its_late_members_are_dropped(
    tmp_path: Path,
) -> None:
    """With ``group_deadline_s``, a group that has ``min_group_members`` by its deadline
    goes to training with them (advantages over the members present); a member arriving
    after that is dropped as ``late``, settled, and not a dead letter; a group with
    fewer members waits and is dropped at ``group_timeout_s`` as before."""
    from pipeline.train.batching import assemble

    intake = _Intake(tmp_path, 7, group_timeout_s=60, group_deadline_s=5, min_group_members=3)
    trainer = intake.trainer

    def send(gid: str, index: int, reward: float) -> None:
        intake.send(gid, index, reward=reward)

    for i, reward in enumerate((1.0, 0.0, 0.0)):
        send("slow", i, reward)
    send("sparse", 0, 1.0)
    send("sparse", 1, 0.0)
    start = min(g.first_seen for g in trainer.buffer)
    trainer._expire_groups(now=start + 1.0)
    assert len(trainer.ready) == 0 and trainer.partial_groups == 0
    trainer._expire_groups(now=start + 6.0)
    assert len(trainer.ready) == 1 and trainer.partial_groups == 1
    (group,) = trainer.ready.take(1)
    assert group.group_id == "slow" and sorted(group.members) == [0, 1, 2]
    batch, _ = assemble([group], 4, (64,))
    # advantages over the three present: rewards 1, 0, 0 (mean 1/3), the padding row 0
    adv = np.asarray(batch.advantage)
    assert adv[0] > 0 > adv[1] and adv[1] == adv[2] and adv[3] == 0
    assert np.asarray(batch.valid).tolist() == [1, 1, 1, 0]
    send("slow", 3, 1.0)  # after its group went to training
    assert trainer.drops["late"] == 1 and trainer.deadlettered == 0
    assert trainer.tracker.is_settled(("ns.rollouts.math", 0), 5)
    trainer._expire_groups(now=start + 61.0)  # "sparse" never had three members
    assert trainer.drops["incomplete_group"] == 2 and trainer.partial_groups == 1


def test_late_members_kept_are_trained_alone_and_settled_once(tmp_path: Path) -> None:
    """``late_members: train``: a member arriving after its group was trained at its
    deadline goes to the ready queue alone, counted (``late_members``), not dropped; its
    advantage is computed over the group's trained rewards and its own; a repeat of it
    is a duplicate dead letter; dynamic sampling judges it with its group's rewards."""
    from pipeline.train.batching import assemble
    from pipeline.train.config import GRPOConfig, TrainerConfig

    intake = _Intake(
        tmp_path,
        11,
        group_timeout_s=60,
        group_deadline_s=5,
        min_group_members=2,
        late_members="train",
        grpo=GRPOConfig(dynamic_sampling=True),
    )
    trainer = intake.trainer
    for i, reward in enumerate((1.0, 0.0)):
        intake.send("slow", i, reward=reward)
    start = min(g.first_seen for g in trainer.buffer)
    trainer._expire_groups(now=start + 6.0)
    (group,) = trainer.ready.take(1)
    assert sorted(group.members) == [0, 1]
    intake.send("slow", 2, reward=1.0)
    assert trainer.late_members == 1 and "late" not in trainer.drops
    assert len(trainer.ready) == 1
    groups = trainer._fresh_groups()  # rewards 1, 0 then 1: not zero variance
    assert len(groups) == 1 and groups[0].late and sorted(groups[0].members) == [2]
    batch, _ = assemble(groups, 1, (64,))
    assert float(batch.advantage[0]) > 0  # above its group's mean of 1/2
    intake.send("slow", 2, reward=1.0)  # the same member again
    assert trainer.drops["duplicate"] == 1 and trainer.late_members == 1
    with pytest.raises(InvalidConfigError, match="late_members"):
        TrainerConfig(late_members="keep")


def test_masked_stale_tokens_train_what_is_fresh_and_drop_only_what_is_all_stale(
    tmp_path: Path,
) -> None:
    """``stale_tokens: mask``: a trajectory whose first turns are past the staleness bound
    but whose last are not is trained, with no gradient through the stale tokens (in a
    packed batch and one row per trajectory alike); one whose every token is past it is
    dropped as ``stale``. The default (``drop``) drops the first kind whole."""
    from pipeline.train.batching import assemble
    from pipeline.train.config import TrainerConfig

    def intake(**settings: Any) -> _Intake:
        it = _Intake(tmp_path / str(len(settings)), 9, max_staleness=1, **settings)
        it.trainer.version = 5  # versions 3 and older are past the bound
        for i in range(4):
            it.send("mixed", i, versions=(2, 5))
        it.send("old", 0, versions=(2, 3))
        return it

    dropping = intake()
    assert dropping.trainer.drops["stale"] == 5 and len(dropping.trainer.ready) == 0

    masking = intake(stale_tokens="mask")
    trainer = masking.trainer
    assert trainer.drops["stale"] == 1 and len(trainer.ready) == 1
    groups = trainer._fresh_groups()
    assert [g.group_id for g in groups] == ["mixed"]
    packed, members = trainer._assemble(groups, trainer._needs(groups))
    in_packed = [(m.row, m.start) for m in members]
    rows, _ = assemble(groups, 4, (64,), oldest=trainer.version - 1)
    in_rows = [(m.row, 0) for m in members]
    for batch, where in ((packed, in_packed), (rows, in_rows)):
        for m, (r, start) in zip(members, where, strict=True):
            t = m.trajectory
            (old, new) = t.version_spans
            assert (old.version, new.version) == (2, 5)
            mask = np.asarray(batch.mask)[r, start : start + t.num_tokens]
            assert not mask[old.start : old.end].any()  # no gradient through version 2
            assert mask[new.start : new.end].tolist() == t.loss_mask[new.start : new.end].tolist()
            assert mask[new.start : new.end].all()
    # the same group waits past another step: version 5 is still within the bound ...
    trainer.version = 6
    assert not trainer._all_stale([m.trajectory for m in members])
    trainer.version = 7  # ... and no longer at 7
    assert trainer._all_stale([m.trajectory for m in members])
    with pytest.raises(InvalidConfigError, match="stale_tokens"):
        TrainerConfig(stale_tokens="keep")


def test_a_group_deadline_must_be_shorter_than_its_timeout_and_keep_two_members() -> None:
    from pipeline.train.config import TrainerConfig

    with pytest.raises(InvalidConfigError, match="shorter than group_timeout_s"):
        TrainerConfig(group_deadline_s=120, group_timeout_s=60)
    with pytest.raises(InvalidConfigError, match="min_group_members"):
        TrainerConfig(group_deadline_s=5, min_group_members=1)
    with pytest.raises(InvalidConfigError, match="min_group_members"):
        TrainerConfig(group_deadline_s=5, group_size=4, min_group_members=5)
    with pytest.raises(InvalidConfigError, match="group_deadline_s"):
        TrainerConfig(group_deadline_s=float("nan"))
    assert TrainerConfig(group_deadline_s=5, group_size=4, min_group_members=4)


# ---- checkpoint directories and model configurations -----------------------------------


def test_a_snapshot_hashes_every_file_it_copies_and_refuses_links_out_of_the_roots(
    tmp_path: Path,
) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    ckpt = save_params(root / "v3", init_model(CFG, 1), version=3)
    (root / "shared").mkdir()
    (root / "shared" / "extra.bin").write_bytes(b"inside the root")
    (ckpt / "linked").symlink_to(root / "shared")  # a linked directory inside the root
    copy_dir = tmp_path / "copy"
    announced = digest(ckpt)
    assert snapshot(ckpt, [root], copy_dir) == announced
    assert (copy_dir / "linked" / "extra.bin").read_bytes() == b"inside the root"
    assert saved_version(copy_dir) == 3
    # the linked file's bytes are covered: changing them changes the digest
    (root / "shared" / "extra.bin").write_bytes(b"changed")
    assert digest(ckpt) != announced
    # a linked directory that leaves the roots is refused
    outside.mkdir()
    (ckpt / "escape").symlink_to(outside)
    with pytest.raises(ValueError, match="outside the allowed roots"):
        snapshot(ckpt, [root], tmp_path / "copy2")
    (ckpt / "escape").unlink()
    os.mkfifo(ckpt / "pipe")  # reading it would block for ever
    with pytest.raises(ValueError, match="neither a file nor a directory"):
        snapshot(ckpt, [root], tmp_path / "copy3")
    (ckpt / "pipe").unlink()
    (ckpt / "loop").symlink_to(ckpt)
    with pytest.raises(ValueError, match="link loop"):
        snapshot(ckpt, [root], tmp_path / "copy4")
    (ckpt / "loop").unlink()
    (ckpt / "rlstream.json").write_text('{"policy_version": true}')
    with pytest.raises(ValueError, match="no integer version"):
        saved_version(ckpt)


def test_model_configurations_from_announcements_are_checked_before_use() -> None:
    good = ModelConfig().to_json()
    assert ModelConfig.from_json(good) == ModelConfig()
    for bad in (
        json.dumps({**json.loads(good), "num_heads": 0}),
        json.dumps({**json.loads(good), "d_model": True}),
        json.dumps({**json.loads(good), "max_len": 2**40}),
        json.dumps({**json.loads(good), "bogus": 1}),
        "[1, 2]",
        "{" * 100_000,
        "not json",
    ):
        with pytest.raises(InvalidConfigError):
            ModelConfig.from_json(bad)


# ---- the remote environment protocol and server ----------------------------------------


def test_protocol_versions_and_sequence_numbers_are_exact() -> None:
    with pytest.raises(protocol.ConnectorError):
        protocol.decode(b'{"version": true}')
    with pytest.raises(protocol.ConnectorError):
        protocol.decode(b'{"version": 1.0}')
    host = SessionHost("guess")

    async def main() -> None:
        await host.handle("reset", "s", {"version": 1, "seed": 1})
        with pytest.raises(HostError) as e:
            await host.handle("step", "s", {"version": 1, "seq": 0, "action": "1"})
        assert (e.value.status, e.value.code) == (400, "bad_request")

    asyncio.run(main())


def test_sessions_are_bounded_in_bytes_each_and_together() -> None:
    host = SessionHost("guess", max_session_bytes=2000, max_total_bytes=5000)
    task = {"task_id": "t", "params": {"secret": 3, "pad": "x" * 1500}}

    async def main() -> None:
        with pytest.raises(HostError) as e:
            big = {"task_id": "t", "params": {"secret": 3, "pad": "x" * 900_000}}
            await host.handle("reset", "big", {"version": 1, "task": big})
        assert (e.value.status, e.value.code) == (413, "too_large")
        for i in range(3):
            await host.handle("reset", f"s{i}", {"version": 1, "task": task})
        assert 4500 <= host.held_bytes <= 5000
        with pytest.raises(HostError) as e:
            await host.handle("reset", "s3", {"version": 1, "task": task})
        assert (e.value.status, e.value.code) == (503, "overloaded")
        await host.close("s0")
        await host.handle("reset", "s3", {"version": 1, "task": task})  # room again

    asyncio.run(main())


def test_the_server_answers_oversized_and_half_sent_bodies_in_json() -> None:
    from aiohttp import web

    async def main() -> None:
        runner = web.AppRunner(http_app(SessionHost("guess"), body_timeout_s=0.5))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            # 10 MB declared: refused at once, in the protocol's JSON
            status, body = await _raw(port, b"PUT", 10_000_000, b"x" * 1000)
            assert status == 413 and json.loads(body)["error"]["code"] == "too_large"
            # 2 MiB sent in chunks, with no length declared: refused in JSON too
            chunk = b"x" * 65536
            chunked = (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 32 + b"0\r\n\r\n"
            status, body = await _raw(port, b"PUT", None, chunked)
            assert status == 413 and json.loads(body)["error"]["code"] == "too_large"
            # a body that stops half-way is not waited for
            start = time.monotonic()
            status, body = await _raw(port, b"PUT", 100, b'{"version": 1')
            assert status == 408 and json.loads(body)["error"]["code"] == "timeout"
            assert time.monotonic() - start < 5
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_the_server_closes_half_sent_requests_and_bounds_its_connections() -> None:
    """Clients that send half a request line and nothing more (slowloris) were held
    open without limit: now a connection that delivers no headers within the bound is
    closed, connections past the limit are closed as they arrive, and a real request
    is still answered meanwhile."""
    from aiohttp import web

    from connectors.limits import ConnectionGuard, listen

    async def main() -> None:
        guard = ConnectionGuard(max_connections=40, header_timeout_s=1.0)
        runner = web.AppRunner(http_app(SessionHost("guess"), guard=guard), keepalive_timeout=1.0)
        await runner.setup()
        server = await listen(runner, guard, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            slow = []
            for _ in range(100):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /v1/hea")  # half a request line, then nothing
                slow.append((reader, writer))
            await asyncio.sleep(0.2)
            assert guard.open <= 40 and guard.refused >= 60
            start = time.monotonic()
            closed = await asyncio.gather(
                *(asyncio.wait_for(r.read(), 5) for r, _ in slow), return_exceptions=True
            )
            assert all(c == b"" for c in closed), closed[:3]  # every one closed by the server
            assert time.monotonic() - start < 3
            assert guard.open == 0 and guard.expired >= 1
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 200")
            for _, w in slow:
                w.close()
            writer.close()
        finally:
            server.close()
            await runner.cleanup()

    asyncio.run(main())


async def _raw(port: int, method: bytes, length: int | None, body: bytes) -> tuple[int, bytes]:
    """One request written by hand (``length`` None: chunked); the status and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    framing = b"Transfer-Encoding: chunked" if length is None else b"Content-Length: %d" % length
    writer.write(
        method
        + b" /v1/sessions/abc HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + framing
        + b"\r\n\r\n"
        + body
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status = int(head.split()[1])
    size = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    data = await asyncio.wait_for(reader.readexactly(size), 10)
    writer.close()
    return status, data


def test_the_http_connector_follows_no_redirect() -> None:
    from aiohttp import web

    from connectors.http import HttpEnvironment

    hits: list[str] = []

    async def elsewhere(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({"version": 1, "observation": "stolen"})

    async def main() -> None:
        other = web.Application()
        other.router.add_route("*", "/{tail:.*}", elsewhere)
        r2 = web.AppRunner(other)
        await r2.setup()
        await web.TCPSite(r2, "127.0.0.1", 0).start()
        target = f"http://127.0.0.1:{r2.addresses[0][1]}"

        async def redirect(request: web.Request) -> web.Response:
            raise web.HTTPTemporaryRedirect(target + request.path)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", redirect)
        r1 = web.AppRunner(app)
        await r1.setup()
        await web.TCPSite(r1, "127.0.0.1", 0).start()
        env = HttpEnvironment(f"http://127.0.0.1:{r1.addresses[0][1]}", attempts=1)
        try:
            with pytest.raises(protocol.ConnectorError, match="redirects are refused"):
                await env.reset(Task("t", {}))
        finally:
            from connectors.base import close_shared

            await close_shared()
            await r1.cleanup()
            await r2.cleanup()

    asyncio.run(main())
    assert hits == []


# ---- episodes --------------------------------------------------------------------------


class Answering(Environment):
    """Answers every step with ``reward`` and ``observation``, never done."""

    name = "answering"

    def __init__(self, reward: float, observation: str) -> None:
        self.reward, self.observation = reward, observation

    def sample_task(self, rng: random.Random) -> Task:
        return Task("x")

    async def reset(self, task: Task) -> str:
        return "go"

    async def step(self, action: str) -> Step:
        return Step(self.observation, self.reward, False)


def slot() -> GroupSlot:
    return GroupSlot("g", 2, 0, Task("x"))


def test_rewards_that_overflow_end_the_episode_with_a_record_that_encodes() -> None:
    turns = [[*TOK.encode("1"), TOK.eos]] * 4
    t = asyncio.run(
        run_episode(
            Answering(1e308, "again"),
            slot(),
            ScriptedPolicy(turns),  # type: ignore[arg-type]
            0,
            TOK,
            EpisodeLimits(8),
            "p",
        )
    )
    assert t.status == "env_error" and t.reward == 0.0
    CODEC.encode(t)


def test_an_endless_observation_is_cut_and_the_context_never_overflows() -> None:
    from pipeline.policy.config import SamplingConfig
    from pipeline.policy.sampler import DecodeEngine
    from pipeline.policy.server import PolicyServer

    engine = DecodeEngine(init_model(CFG, 3), 2, SamplingConfig(1.0, seed=4), chunk=8)
    server = PolicyServer(engine, {TOK.eos, TOK.end_call}).start()
    huge = "\U0001f600" * 65_536  # 64 Ki four-byte characters: 256 KiB of tokens
    limits = EpisodeLimits(max_new_tokens=4, max_observation_tokens=32)

    async def main() -> tuple[Any, float]:
        await run_episode(Answering(0.0, "x"), slot(), server, 1, TOK, limits, "p")  # compile
        start = time.monotonic()
        t = await run_episode(Answering(0.0, huge), slot(), server, 0, TOK, limits, "p")
        return t, time.monotonic() - start

    t, took = asyncio.run(main())
    server.stop()
    assert t.status == "truncated" and t.num_tokens <= CFG.max_len
    observations = [turn for turn in t.turns if turn.role == "environment"]
    assert observations and all(o.end - o.start <= 32 for o in observations)
    assert took < 10
    CODEC.encode(t)


def test_weights_paths_are_resolved_for_a_person_or_refused_naming_the_newest(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    model = init_model(CFG, 1)
    for v in (3, 5):
        save_params(run / "weights" / f"v{v}", model, version=v)
    (run / "weights" / "v9").mkdir()  # a version being written: no version file yet
    newest = run / "weights" / "v5"
    assert find_weights(run) == newest
    assert find_weights(run / "weights") == newest
    assert find_weights(run / "weights" / "v3") == run / "weights" / "v3"
    # a trainer checkpoint names the version it published
    ckpt = run / "checkpoints" / "12"
    (ckpt / "meta").mkdir(parents=True)
    (ckpt / "meta" / "metadata").write_text(json.dumps({"version": 3, "seq": 12}))
    assert find_weights(ckpt) == run / "weights" / "v3"
    (ckpt / "meta" / "metadata").write_text(json.dumps({"version": 1}))
    with pytest.raises(InvalidConfigError, match="no longer kept; the newest available is"):
        find_weights(ckpt)
    (ckpt / "meta" / "metadata").write_text("{not json")
    with pytest.raises(InvalidConfigError, match="not a trainer checkpoint"):
        find_weights(ckpt)
    with pytest.raises(InvalidConfigError, match=r"no policy weights at .*v7; the newest"):
        find_weights(run / "weights" / "v7")
    with pytest.raises(InvalidConfigError, match="no policy weights at /nonexistent; give"):
        find_weights(Path("/nonexistent"))
    (tmp_path / "empty" / "weights").mkdir(parents=True)
    with pytest.raises(InvalidConfigError, match="holds no weights yet"):
        find_weights(tmp_path / "empty")


def test_an_evaluation_whose_policy_failed_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing policy thread ended every episode as a failure and ``eval`` reported a
    success rate (exit 0): now the evaluation itself fails, with the cause."""
    from pipeline.errors import RlstreamError
    from pipeline.policy.sampler import DecodeEngine
    from pipeline.rollout.evaluate import evaluate

    def broken(self: DecodeEngine, slots: list[int]) -> Any:
        raise FloatingPointError("the logits are NaN")

    monkeypatch.setattr(DecodeEngine, "step", broken)
    with pytest.raises(
        RlstreamError, match="policy failed: FloatingPointError: the logits are NaN"
    ):
        evaluate("guess", model=CFG, episodes=4, concurrency=4)
