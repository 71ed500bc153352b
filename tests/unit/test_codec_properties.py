"""Property-based tests: random valid trajectories round-trip; random bytes never crash
or hang the decoder (only RecordDecodeError, quickly)."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.errors import RecordDecodeError
from pipeline.records.codec import MARKER, TrajectoryCodec
from pipeline.records.trajectory import ROLES, STATUSES, Timings, Trajectory, Turn, VersionSpan

CODEC = TrajectoryCodec()
text = st.text(max_size=20)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def trajectories(draw: st.DrawFn) -> Trajectory:
    n = draw(st.integers(0, 300))
    tokens = np.asarray(
        draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n)), dtype="<i4"
    )
    mask = np.asarray(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), dtype="u1")
    lp = np.where(
        mask == 1,
        -np.asarray(
            draw(st.lists(st.floats(0, 50, width=32), min_size=n, max_size=n)) or [0.0] * n
        ),
        0,
    )
    cuts = sorted(set([*draw(st.lists(st.integers(0, n), max_size=6)), 0, n]))
    spans, turns = [], []
    version = draw(st.integers(0, 2**40))
    for a, b in itertools.pairwise(cuts):
        if b > a:
            spans.append(VersionSpan(a, b, version))
            version += draw(st.integers(0, 3))
            turns.append(Turn(draw(st.sampled_from(ROLES)), a, b, draw(text), draw(finite)))
    size = draw(st.integers(1, 64))
    return Trajectory(
        trajectory_id=draw(text),
        group_id=draw(text),
        group_size=size,
        group_index=draw(st.integers(0, size - 1)),
        task_id=draw(text),
        producer_id=draw(text),
        env=draw(text),
        tokenizer_id=draw(text),
        tokens=tokens,
        loss_mask=mask,
        logprobs=lp.astype("<f4"),
        version_spans=spans,
        turns=turns,
        reward=draw(finite),
        rewards=draw(st.dictionaries(text, finite, max_size=3)),
        status=draw(st.sampled_from(STATUSES)),
        timings=Timings(
            draw(st.integers(0, 2**50)), draw(st.integers(0, 2**50)), draw(finite), draw(finite)
        ),
        metadata=draw(st.dictionaries(text, text, max_size=3)),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajectories())
def test_random_trajectories_round_trip(t: Trajectory) -> None:
    back = CODEC.decode(CODEC.encode(t))
    for name in Trajectory.__slots__:
        x, y = getattr(t, name), getattr(back, name)
        if isinstance(x, np.ndarray):
            assert x.tobytes() == y.tobytes() and x.dtype == y.dtype
        elif isinstance(x, list):
            assert list(x) == list(y)
        else:
            assert x == y


@settings(max_examples=400, deadline=200)
@given(st.binary(max_size=400))
def test_random_bytes_never_crash(data: bytes) -> None:
    for candidate in (data, MARKER + CODEC.fingerprint + data):
        try:
            CODEC.decode(candidate)
        except RecordDecodeError:
            pass


@settings(max_examples=300, deadline=200)
@given(st.data())
def test_corrupted_records_never_crash(data: st.DataObject) -> None:
    from pipeline.testing import make_trajectory

    good = bytearray(CODEC.encode(make_trajectory(32, rng=np.random.default_rng(0), turns=3)))
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(10, len(good) - 1))
        good[i] = data.draw(st.integers(0, 255))
    try:
        CODEC.decode(bytes(good))
    except RecordDecodeError:
        pass
