"""The C path of the record codec and of the record contract against their Python
references: the same bytes written, the same values read, the same refusals (reason and
message), for every schema rlstream ships, on valid input and on corrupt input."""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.errors import InvalidTrajectoryError, RecordDecodeError
from pipeline.records import avro_program, tensor
from pipeline.records import trajectory as contract
from pipeline.records.avro_binary import CompiledSchema, native_available
from pipeline.records.codec import TrajectoryCodec, to_avro_dict
from pipeline.records.schema_store import default_store
from pipeline.records.trajectory import Trajectory, Turns, VersionSpan, find_violation
from pipeline.testing import make_trajectory
from tests.unit.test_codec_properties import trajectories

C_CODEC = TrajectoryCodec(native=True) if native_available() else None
PY_CODEC = TrajectoryCodec(native=False)
RECORDS = (
    "Trajectory",
    "WeightsAnnouncement",
    "WeightsChunk",
    "DeadLetter",
    "Telemetry",
    "ProducerHeartbeat",
    "RecordedTrajectory",
)


def test_the_c_extensions_are_built_and_chosen() -> None:
    assert avro_program._avro_native is not None, (
        "pipeline.records._avro_native was not built: install a C compiler and run "
        "pip install -e . again (rlstream runs without it, slower)"
    )
    assert contract._native is not None, "pipeline.records._contract_native was not built"
    assert native_available()
    assert TrajectoryCodec().native
    assert contract._scan is not None
    assert not PY_CODEC.native


# ---- random values of any schema --------------------------------------------------------

INTS = (0, 1, -1, 63, 64, -64, -65, 8191, 8192, -8193, 2**31 - 1, -(2**31))
LONGS = (*INTS, 2**40, 2**63 - 1, -(2**63))
DOUBLES = (0.0, -0.0, 1.5, -2.25e300, 5e-324, float("inf"), float("-inf"), float("nan"))


def random_value(s: Any, rng: random.Random, named: dict[str, Any]) -> Any:
    """A random value of Avro schema ``s`` (parsing canonical form), edge cases often."""
    if isinstance(s, list):
        null = s.index("null")
        value = random_value(s[1 - null], rng, named)  # names a type defined in it
        return None if rng.random() < 0.3 else value
    if isinstance(s, str) and s in named:
        return random_value(named[s], rng, named)
    kind = s if isinstance(s, str) else s["type"]
    if isinstance(s, dict) and "name" in s:
        named[s["name"]] = s
    if kind == "null":
        return None
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice(INTS) if rng.random() < 0.5 else rng.randint(-(2**31), 2**31 - 1)
    if kind == "long":
        return rng.choice(LONGS) if rng.random() < 0.5 else rng.randint(-(2**63), 2**63 - 1)
    if kind == "float":
        return float(np.float32(rng.uniform(-1e30, 1e30)))
    if kind == "double":
        return rng.choice(DOUBLES) if rng.random() < 0.3 else rng.uniform(-1e9, 1e9)
    if kind == "string":
        alphabet = string.printable + "éß中\U0001f600\x00"
        return "".join(rng.choice(alphabet) for _ in range(rng.choice((0, 3, 63, 64, 70))))
    if kind == "bytes":
        return rng.randbytes(rng.choice((0, 1, 63, 64, 200)))
    if kind == "fixed":
        return rng.randbytes(s["size"])
    if kind == "enum":
        return rng.choice(s["symbols"])
    if kind == "array":
        return [random_value(s["items"], rng, named) for _ in range(rng.choice((0, 2, 65)))]
    if kind == "map":
        return {
            random_value("string", rng, named): random_value(s["values"], rng, named)
            for _ in range(rng.choice((0, 2, 65)))
        }
    if kind == "record":
        return {f["name"]: random_value(f["type"], rng, named) for f in s["fields"]}
    raise AssertionError(kind)


def outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    """What ``fn`` returned (its repr: NaN equals NaN) or the refusal it raised."""
    try:
        return "value", repr(fn())
    except RecordDecodeError as e:
        return e.reason, str(e)


def mutations(data: bytes, rng: random.Random, count: int) -> Iterator[bytes]:
    """Corrupt copies of ``data``: flipped and overwritten bytes, cuts, insertions,
    varints that never end, huge and negative counts."""
    for _ in range(count):
        b = bytearray(data)
        pos = rng.randrange(len(b))
        op = rng.randrange(6)
        if op == 0:
            b[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[pos] = rng.choice((0x00, 0x01, 0x7F, 0x80, 0xFE, 0xFF))
        elif op == 2:
            del b[pos:]
        elif op == 3:
            b[pos:pos] = rng.randbytes(rng.randint(1, 12))
        elif op == 4:
            b[pos : pos + 11] = b"\xff" * rng.randint(9, 11) + b"\x01"
        else:
            b[pos : pos + 1] = rng.choice((b"\x01", b"\x03\x00", b"\xfe\xff\xff\xff\x0f"))
        yield bytes(b)


# ---- the codec ----------------------------------------------------------------------------


@pytest.mark.parametrize("record", RECORDS)
def test_every_schema_writes_and_reads_alike_in_c_and_python(record: str) -> None:
    """Plain values (dicts) of each shipped schema: the same bytes, the same values, and
    for 300 corruptions of them the same answer, refusal by refusal."""
    canonical = default_store().reader(record).canonical_form
    c, py = CompiledSchema(canonical, native=True), CompiledSchema(canonical, native=False)
    rng = random.Random(record)
    refusals: set[str] = set()
    for _ in range(30):
        value = random_value(json.loads(canonical), rng, {})
        data = py.encode(value, b"\xc3\x01")
        assert c.encode(value, b"\xc3\x01") == data
        assert outcome(lambda d=data: c.decode(d, 2)) == outcome(lambda d=data: py.decode(d, 2))
        for bad in mutations(data, rng, 10):
            got = outcome(lambda b=bad: c.decode(b, 2))
            assert got == outcome(lambda b=bad: py.decode(b, 2)), bad.hex()
            refusals.add(got[0])
    assert {"truncated", "bad_length"} <= refusals  # the corruptions reached the checks


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajectories(), st.randoms(use_true_random=False))
def test_trajectories_write_and_read_alike_in_c_and_python(
    t: Trajectory, rng: random.Random
) -> None:
    assert C_CODEC is not None
    data = PY_CODEC.encode(t)
    assert C_CODEC.encode(t) == data
    framed = PY_CODEC.encode(t, b"\x00\x00\x00\x00\x07")
    assert C_CODEC.encode(t, b"\x00\x00\x00\x00\x07") == framed
    for bad in [data, *mutations(data, rng, 12)]:
        c = outcome(lambda b=bad: to_avro_dict(C_CODEC.decode(b)))
        assert c == outcome(lambda b=bad: to_avro_dict(PY_CODEC.decode(b))), bad.hex()


@pytest.mark.parametrize(
    "array",
    [
        np.arange(5, dtype="<f8")[::2],  # strided: the generic writer
        np.arange(6, dtype="<i4").reshape(2, 3),  # 2-D
        np.arange(3, dtype=">i4"),  # big-endian
        np.zeros(0, dtype="u1"),
        np.ones(70, dtype="bool"),
        np.arange(9, dtype="<u8"),
        np.arange(40, dtype="<f2"),
    ],
    ids=["strided", "2d", "big-endian", "empty", "bool", "uint64", "float16"],
)
def test_tensors_of_every_shape_write_and_read_alike(array: np.ndarray) -> None:
    import ml_dtypes

    canonical = default_store().reader("Tensor").canonical_form
    adapters = {"rlstream.Tensor": tensor.tensor_fields}
    factories = {"rlstream.Tensor": tensor.tensor_from_avro}
    shortcuts = {"rlstream.Tensor": tensor.SHORTCUT}
    c = CompiledSchema(canonical, adapters, factories, shortcuts, native=True)
    py = CompiledSchema(canonical, adapters, factories, shortcuts, native=False)
    for a in (array, array.astype(ml_dtypes.bfloat16)):
        data = py.encode(a)
        assert c.encode(a) == data
        (back_c, end_c), (back_py, end_py) = c.decode(data), py.decode(data)
        assert end_c == end_py == len(data)
        assert back_c.dtype == back_py.dtype == a.dtype.newbyteorder("<")
        assert back_c.shape == back_py.shape == a.shape
        assert back_c.tobytes() == back_py.tobytes()
        assert np.array_equal(back_c.astype(np.float64), a.astype(np.float64))
        assert not back_c.flags.writeable


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
def test_values_of_the_wrong_python_type_are_refused_as_invalid_trajectories(
    native: bool,
) -> None:
    from dataclasses import replace

    codec = TrajectoryCodec(native=native)
    t = make_trajectory(8)
    for change in (
        {"trajectory_id": 5},
        {"metadata": {"k": 5}},
        {"metadata": [("k", "v")]},
        {"rewards": {"k": "x"}},
        {"reward": None},
        {"timings": (1, 2, 3)},
        {"group_size": 2**40},
        {"tokens": list(range(8))},
        {"version_spans": [(0, 8)]},
        {"status": 3},
        {"turns": [("user", 0, 8)]},
    ):
        with pytest.raises(InvalidTrajectoryError, match=r"invalid|bad_enum"):
            codec.encode(replace(t, **change))


# ---- the contract ---------------------------------------------------------------------


def corrupt(t: Trajectory, rng: random.Random) -> Trajectory:
    """``t`` broken in one to three ways the contract checks, or left whole."""
    from dataclasses import replace

    n = t.num_tokens
    for _ in range(rng.randint(0, 3)):
        op = rng.randrange(9)
        mask, lp = t.loss_mask.copy(), t.logprobs.copy()
        turns = Turns.of(t.turns)
        if op == 0 and n:
            mask[rng.randrange(n)] = rng.choice((2, 255))
            t = replace(t, loss_mask=mask)
        elif op == 1 and n:
            lp[rng.randrange(n)] = rng.choice((np.nan, np.inf, -np.inf))
            t = replace(t, logprobs=lp)
        elif op == 2 and t.version_spans:
            spans = list(t.version_spans)
            k = rng.randrange(len(spans))
            s = spans[k]
            spans[k] = rng.choice(
                (VersionSpan(s.end, s.start, s.version), VersionSpan(s.start, n + 1, s.version))
            )
            t = replace(t, version_spans=spans)
        elif op == 3 and t.version_spans:
            t = replace(t, version_spans=list(t.version_spans)[1:])
        elif op == 4 and len(turns):
            roles = turns.roles.copy()
            roles[rng.randrange(len(roles))] = rng.choice((5, 200))
            t = replace(t, turns=Turns(roles, turns.starts, turns.ends, turns.latency_s))
        elif op == 5 and len(turns) > 1:
            starts = turns.starts.copy()
            starts[rng.randrange(len(starts))] = rng.choice((-1, n + 1, 0))
            t = replace(t, turns=Turns(turns.roles, starts, turns.ends, turns.latency_s))
        elif op == 6:
            t = replace(t, reward=rng.choice((float("nan"), float("inf"))))
        elif op == 7:
            t = replace(t, status="lost")
        else:
            t = replace(t, turns=Turns(turns.roles, turns.starts, turns.ends, turns.latency_s[:0]))
    return t


def both_contracts(t: Trajectory) -> tuple[Any, Any]:
    return find_violation(t, native=True), find_violation(t, native=False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajectories(), st.randoms(use_true_random=False))
def test_the_contract_finds_the_same_first_violation_in_c_and_python(
    t: Trajectory, rng: random.Random
) -> None:
    t.turns = Turns.of(t.turns)
    broken = corrupt(t, rng)
    c, py = both_contracts(broken)
    assert c == py


def test_the_contract_finds_each_violation_alike_on_long_records() -> None:
    rng = random.Random(7)
    found = set()
    for k in range(400):
        t = make_trajectory(rng.choice((0, 1, 100, 5000)), turns=rng.choice((1, 8, 40)))
        c, py = both_contracts(corrupt(t, rng))
        assert c == py, k
        found.add(c[1] if c else None)
    assert len(found) >= 8  # every kind of violation came up


def test_a_list_emptied_while_it_is_written_is_written_as_it_was() -> None:
    """Writing an item may run Python code (``__index__`` here) that changes the list
    being written: the C writer works on a copy, so the record stays whole and memory
    safe."""

    class Clears:
        def __init__(self, victim: list[Any]) -> None:
            self.victim = victim

        def __index__(self) -> int:
            self.victim.clear()
            return 1

    canonical = default_store().reader("Tensor").canonical_form
    c = CompiledSchema(canonical, native=True)
    shape: list[Any] = [2, 3]
    shape.insert(0, Clears(shape))
    data = c.encode({"dtype": "uint8", "shape": shape, "data": b"\x00" * 6})
    assert shape == []
    assert c.decode(data)[0]["shape"] == [1, 2, 3]
