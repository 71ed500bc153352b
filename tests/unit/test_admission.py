"""The admission rule across producers, computed by hand."""

from __future__ import annotations

from pipeline.rollout.admission import JOIN_ROUNDS, Gate, decide


def test_one_producer_fills_the_budget_and_no_more() -> None:
    # budget 64, groups of 8: 56 outstanding leaves room for one more group, 57 does not
    assert decide(budget=64, group_size=8, lag=40, unpolled=8, own_in_flight=8, peers={}).admit
    d = decide(budget=64, group_size=8, lag=40, unpolled=9, own_in_flight=8, peers={})
    assert not d.admit and d.outstanding == 57 and d.share == 64 and d.peers == 0


def test_the_peers_episodes_in_flight_count_against_the_budget() -> None:
    alone = decide(budget=64, group_size=8, lag=16, unpolled=0, own_in_flight=8, peers={})
    assert alone.admit
    d = decide(
        budget=64, group_size=8, lag=16, unpolled=0, own_in_flight=8, peers={"b": 16, "c": 16}
    )
    assert d.outstanding == 56 and d.admit  # 56 + 8 = 64 fits
    d = decide(
        budget=64, group_size=8, lag=17, unpolled=0, own_in_flight=8, peers={"b": 16, "c": 16}
    )
    assert not d.admit


def test_each_producer_keeps_to_its_share_of_the_budget() -> None:
    # four producers: a share of 16 each, whatever room the others leave
    peers = {"b": 0, "c": 0, "d": 0}
    d = decide(budget=64, group_size=8, lag=0, unpolled=0, own_in_flight=8, peers=peers)
    assert d.share == 16 and d.admit  # 8 + 8 <= 16
    d = decide(budget=64, group_size=8, lag=0, unpolled=0, own_in_flight=16, peers=peers)
    assert not d.admit  # 16 + 8 > 16, although 24 of 64 are outstanding


def test_a_share_is_never_below_one_group_and_an_idle_pipeline_always_admits() -> None:
    peers = {f"p{i}": 0 for i in range(15)}  # 16 producers, budget 64: 4 each < a group
    d = decide(budget=64, group_size=8, lag=0, unpolled=0, own_in_flight=0, peers=peers)
    assert d.share == 8 and d.admit
    # a budget smaller than a group: one group may still start when nothing is outstanding
    assert decide(budget=4, group_size=8, lag=0, unpolled=0, own_in_flight=0, peers={}).admit
    assert not decide(budget=4, group_size=8, lag=1, unpolled=0, own_in_flight=0, peers={}).admit


def test_weights_behind_the_trainer_shrink_the_budget() -> None:
    # max_staleness 2 of batches of 64, the producer one version behind: one batch left
    one_behind = decide(
        budget=(2 - 1) * 64, group_size=8, lag=56, unpolled=0, own_in_flight=0, peers={}
    )
    assert one_behind.admit  # 56 + 8 <= 64
    assert not decide(budget=64, group_size=8, lag=57, unpolled=0, own_in_flight=0, peers={}).admit
    # two behind: nothing may start, not even into an idle pipeline
    assert not decide(budget=0, group_size=8, lag=0, unpolled=0, own_in_flight=0, peers={}).admit


def test_producers_who_see_the_same_free_budget_take_a_part_each() -> None:
    # budget 128, the trainer just trained a batch: 64 free. Neither producer has heard of
    # the other's new episodes yet; each may take 32, not 64 (together: 64, not 128)
    for own, admit in ((0, True), (24, True), (25, False), (32, False)):
        d = decide(budget=128, group_size=8, lag=64, unpolled=0, own_in_flight=own, peers={"b": 0})
        assert d.admit is admit, own
    assert d.share == 64  # each producer's share of the whole budget, as reported


def _start_together(*, joining: bool, late_by: int) -> list[int]:
    """Two producers, no trainer (budget 16, groups of 4). ``b`` beats its first heartbeat
    ``late_by`` rounds after ``a``; each heartbeat is read by the other only in its next
    round, and ``a`` hears of ``b`` one round after ``b`` read ``a``'s heartbeat: the order in
    which two producers starting at the same moment can see each other at their worst."""
    budget, group = 16, 4
    in_flight = {"a": 0, "b": 0}
    announced = {"a": 0, "b": 0}
    started_at = {"a": 0, "b": late_by}
    for r in range(12):
        for me, peer in (("a", "b"), ("b", "a")):
            if r < started_at[me]:
                continue
            peer_heard = r > started_at[peer] if me == "a" else r >= started_at[peer]
            peers = {peer: announced[peer]} if peer_heard else {}
            announced[me] = in_flight[me]  # this round's heartbeat, read by the peer later
            rounds_known = r - started_at[me]
            while decide(
                budget=budget,
                group_size=group,
                lag=0,
                unpolled=0,
                own_in_flight=in_flight[me],
                peers=peers,
                announced=announced[me] if joining and rounds_known < JOIN_ROUNDS else None,
            ).admit:
                in_flight[me] += group
    return [in_flight["a"], in_flight["b"]]


def test_producers_starting_together_overshoot_the_budget_by_one_group_at_most() -> None:
    # a joining producer holds at most one group more than its last heartbeat said, so
    # whoever reads that heartbeat is misled by one group, not by a whole share
    for late_by in range(8):
        started = _start_together(joining=True, late_by=late_by)
        assert 16 <= sum(started) <= 16 + 4, (late_by, started)
    # without it, the first producer takes the whole budget before the second is heard
    # of, and the second reads a heartbeat from before that: 24 (seen on a loaded machine)
    assert _start_together(joining=False, late_by=0) == [16, 8]


def test_a_decision_names_what_holds_the_producer_back() -> None:
    """Records the trainer has not read fill the budget (``untrained``), or episodes in
    flight hold what they leave (``in_flight``), or the weights are too far behind
    (``weights_behind``), or the producer is still joining; an admitted group has none."""

    def cause(lag: int, unpolled: int, own_in_flight: int) -> str:
        return decide(
            budget=64,
            group_size=8,
            lag=lag,
            unpolled=unpolled,
            own_in_flight=own_in_flight,
            peers={},
        ).cause

    assert cause(lag=40, unpolled=8, own_in_flight=8) == ""
    assert cause(lag=50, unpolled=8, own_in_flight=0) == "untrained"
    assert cause(lag=8, unpolled=0, own_in_flight=56) == "in_flight"
    d = decide(budget=0, group_size=8, lag=0, unpolled=0, own_in_flight=0, peers={})
    assert not d.admit and d.cause == "weights_behind"
    d = decide(
        budget=64, group_size=8, lag=0, unpolled=0, own_in_flight=16, peers={"b": 0}, announced=8
    )
    assert not d.admit and d.cause == "joining"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _ready_gate(clock: _Clock, **kw: int) -> Gate:
    """A gate of budget 2 x 16 (groups of 4) whose peers are known and past joining."""
    gate = Gate(max_staleness=2, trainer_batch=16, group_size=4, clock=clock, **kw)
    for _ in range(JOIN_ROUNDS + 1):
        gate.heard({}, 0, 0, ready=True)
    return gate


def test_the_gate_holds_every_group_until_the_peers_are_known() -> None:
    gate = Gate(max_staleness=2, trainer_batch=16, group_size=4, clock=_Clock())
    assert not gate.may_start(in_flight=0, sent=0, version=0, announced_version=None)
    gate.heard({}, 0, 0, ready=False)
    assert not gate.may_start(in_flight=0, sent=0, version=0, announced_version=None)
    gate.heard({}, 0, 0, ready=True)
    assert gate.may_start(in_flight=0, sent=0, version=0, announced_version=None)
    # joining: at most one group beyond what the last heartbeat announced (0)
    assert not gate.may_start(in_flight=4, sent=0, version=0, announced_version=None)
    assert gate.paused_by()["joining"] == 0.0  # no time has passed on its clock yet


def test_the_gate_counts_records_written_since_the_poll_and_versions_behind() -> None:
    clock = _Clock()
    gate = _ready_gate(clock)
    gate.polled(lag=20, settled=10)
    # 20 unread + (18 - 10) written since the poll + 0 in flight = 28: one group fits 32
    assert gate.may_start(in_flight=0, sent=18, version=5, announced_version=5)
    assert not gate.may_start(in_flight=0, sent=19, version=5, announced_version=5)
    assert gate.paused and gate.share == 32
    # one version behind: the budget is one batch, which the backlog already fills
    gate.polled(lag=0, settled=19)
    assert gate.may_start(in_flight=0, sent=19, version=5, announced_version=5)
    assert not gate.may_start(in_flight=16, sent=19, version=4, announced_version=5)
    assert gate.behind == 1
    assert not gate.may_start(in_flight=0, sent=19, version=3, announced_version=5)
    assert gate.behind == 2 and gate.share == 0


def test_the_gate_times_each_pause_by_its_cause_on_its_own_clock() -> None:
    clock = _Clock()
    gate = _ready_gate(clock)
    gate.polled(lag=30, settled=0)  # 30 unread of 32: no room for a group of 4
    assert not gate.may_start(in_flight=0, sent=0, version=0, announced_version=None)
    clock.now += 2.5
    gate.polled(lag=8, settled=0)  # the trainer read; episodes in flight now hold the room
    assert not gate.may_start(in_flight=24, sent=0, version=0, announced_version=None)
    clock.now += 1.0
    assert gate.paused_by() == {
        "weights_behind": 0.0,
        "untrained": 2.5,
        "in_flight": 1.0,
        "joining": 0.0,
    }
    assert gate.may_start(in_flight=8, sent=0, version=0, announced_version=None)
    clock.now += 7.0  # not paused: no time is added
    assert gate.paused_by()["in_flight"] == 1.0 and not gate.paused


def test_synchronous_mode_is_a_batch_per_policy_version() -> None:
    gate = Gate(max_staleness=-1, trainer_batch=16, group_size=4, sync_batch=8)
    for _ in range(2):
        assert gate.may_start(in_flight=0, sent=0, version=0, announced_version=0)
        gate.started(4)
    assert not gate.may_start(in_flight=8, sent=0, version=0, announced_version=0)
    assert gate.waiting
    # the next version is loaded: the next batch may start, whatever is in flight
    assert gate.may_start(in_flight=8, sent=0, version=1, announced_version=1)
    assert not gate.waiting


def test_without_admission_control_every_group_may_start() -> None:
    gate = Gate(max_staleness=-1, trainer_batch=16, group_size=4)
    gate.polled(lag=10_000, settled=0)
    assert gate.may_start(in_flight=10_000, sent=0, version=0, announced_version=9)
