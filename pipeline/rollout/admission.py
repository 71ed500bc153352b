"""Admission control: when a producer may start a new group, with any number of producers.

A group started now is trained after every record the trainer group has not read yet and
after every episode in flight anywhere. To arrive at most ``max_staleness`` policy versions
old, all of those together must fit the staleness budget, ``max_staleness`` trainer steps
of ``trainer_batch`` trajectories. A producer counts:

- the trainer group's lag on the rollout topic (:class:`LagMonitor`, polled), and the
  records not acknowledged by the cluster when that poll began (a record written is in
  the high watermark only once acknowledged): its own (exact) and its peers' (from their
  heartbeats, which carry how many of each one's records are acknowledged; a heartbeat
  older than the poll makes this count a little high, never low);
- its own episodes in flight (exact), and every live peer's, from their heartbeats, where
  a record written and not acknowledged yet still counts as in flight (in flight and
  acknowledged are taken together, so an episode that ends between two heartbeats moves
  from one count to the other and is never missed).

Each producer publishes a :class:`Heartbeats` record (its in-flight count and its share)
on the compacted ``<ns>.producers`` topic every poll interval, keyed by its id; a producer
that stops sends a tombstone, one that dies stops counting once it has been silent for
``heartbeat_timeout_s``. A heartbeat is up to one interval old, so two producers could
both fill the same free budget at once: each therefore also keeps its own episodes in
flight within its part of the free budget (the budget less the trainer's backlog),
divided among the live producers. A producer that joins is counted by the others at its
first heartbeat; nobody restarts. Producers that start at the same moment may each read
the other's heartbeat from before it started anything: for its first ``JOIN_ROUNDS``
heartbeats a producer therefore holds at most one group more than its last heartbeat
said, so that whoever starts next finds it at most one group beyond what it announced.

The budget counts queue positions, assuming the episode starts with the trainer's newest
policy. While a producer samples with weights ``behind`` versions older (a restore in
progress, or announcements it cannot load), an episode started now is older by that much:
its budget is ``max_staleness - behind`` steps.

:class:`Gate` holds a producer's admission state around :func:`decide`: what the last lag
poll and heartbeat exchange said, the pause under way and its cause, and the synchronous
mode (a batch per policy version), which is an admission policy like the others. The
figures it reads from Kafka come from :mod:`pipeline.rollout.peers`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

#: heartbeat rounds (after the peers are known) in which a producer that just started
#: raises its episodes in flight by at most one group per heartbeat
JOIN_ROUNDS = 4


@dataclass(frozen=True)
class Decision:
    """One admission decision and the figures it was made on."""

    admit: bool
    outstanding: int
    share: int
    peers: int
    #: why a group may not start (one of :data:`CAUSES`); empty when it may
    cause: str = ""


#: why admission holds a producer back: its weights are ``max_staleness`` versions behind
#: the trainer's (restoring, or refused); the budget is full of records the trainer has
#: not read (``untrained``: the trainer is the bottleneck); episodes in flight, this
#: producer's or its peers', hold the room left (``in_flight``: slow episodes are); a
#: producer that just started raises its episodes in flight a group at a time (``joining``)
CAUSES = ("weights_behind", "untrained", "in_flight", "joining")


def decide(
    *,
    budget: int,
    group_size: int,
    lag: int,
    unpolled: int,
    own_in_flight: int,
    peers: Mapping[str, int],
    announced: int | None = None,
) -> Decision:
    """May a group of ``group_size`` start now? ``budget``: trajectories that may be
    outstanding (not yet read by the trainer) in all, already less the versions this
    producer's weights are behind the trainer's; ``peers``: the live other producers'
    episodes in flight; ``announced``: while this producer is joining, the episodes in
    flight its last heartbeat announced (it holds at most one group more)."""
    n = 1 + len(peers)
    share = max(group_size, math.ceil(budget / n))
    outstanding = lag + unpolled + own_in_flight + sum(peers.values())
    if announced is not None and own_in_flight > announced:
        return Decision(False, outstanding, share, len(peers), "joining")
    if budget <= 0:  # the trainer is max_staleness versions ahead of our weights already
        return Decision(False, outstanding, 0, len(peers), "weights_behind")
    if outstanding == 0:  # one group may always start when nothing is outstanding
        return Decision(True, 0, share, len(peers))
    # Room for episodes in flight, everyone's; each producer holds at most its part of it
    # (so that producers who see it free at the same moment cannot all take all of it),
    # and one group when it has none in flight (so that many producers never starve).
    free = budget - lag - unpolled
    allowance = free // n if own_in_flight else max(group_size, free // n)
    fits = outstanding + group_size <= budget and own_in_flight + group_size <= allowance
    if fits:
        return Decision(True, outstanding, share, len(peers))
    # held back by the records the trainer has not read when they alone leave no room
    # for a group; otherwise by the episodes in flight
    cause = "untrained" if free < group_size else "in_flight"
    return Decision(False, outstanding, share, len(peers), cause)


class Gate:
    """A producer's admission state, in one object around :func:`decide`.

    The producer tells it what happened (:meth:`polled`: the trainer's lag; :meth:`heard`:
    the peers' heartbeats; :meth:`started`: a group began) and asks :meth:`may_start`
    before each group. With ``sync_batch`` (synchronous mode) the policy is instead: at
    most ``sync_batch`` episodes per policy version, the next batch once the trainer's next
    version is loaded. ``max_staleness < 0``: no admission control. Not thread-safe: the
    producer's event loop is its only caller.
    """

    def __init__(
        self,
        max_staleness: int,
        trainer_batch: int,
        group_size: int,
        sync_batch: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_staleness, self.trainer_batch = max_staleness, trainer_batch
        self.group_size, self.sync_batch = group_size, sync_batch
        self.clock = clock
        #: the trainer group's lag when last polled, and this producer's records settled
        #: (acknowledged or failed) when that poll began
        self.lag = 0
        self.settled_at_poll = 0
        #: live peers and their episodes in flight; records they wrote since the last poll
        self.peers: dict[str, int] = {}
        self.peers_unpolled = 0
        #: no group starts before the peers are known (the heartbeats read to the end of
        #: the log an interval after this producer's first), so that producers starting at
        #: the same moment hear of each other first
        self.peers_known = False
        #: heartbeat rounds since the peers became known, and the episodes in flight this
        #: producer announced in its last heartbeat: for its first ``JOIN_ROUNDS`` rounds a
        #: producer holds at most one group more than it announced, so that a peer that
        #: started at the same moment (and is not heard of yet) never finds it far beyond
        #: its last heartbeat
        self.rounds_known = 0
        self.announced = 0
        #: the last decision's figures: this producer's share of the budget, versions its
        #: weights are behind
        self.share = 0
        self.behind = 0
        self.paused = False
        #: synchronous mode: this version's batch is started, waiting for the next version
        self.waiting = False
        self._cause = ""
        self._cause_since = 0.0
        self._paused_by: dict[str, float] = {}
        self._sync_version = 0
        self._sync_started = 0

    def polled(self, lag: int, settled: int) -> None:
        """The trainer's lag was read; ``settled``: this producer's records settled when
        the poll began."""
        self.lag, self.settled_at_poll = lag, settled

    def heard(self, peers: dict[str, int], unpolled: int, announced: int, ready: bool) -> None:
        """A heartbeat exchange: the live peers' episodes in flight, the records they wrote
        since the last poll, the episodes in flight this producer announced, and whether
        the peers are known now."""
        self.peers, self.peers_unpolled, self.announced = peers, unpolled, announced
        self.rounds_known += self.peers_known
        self.peers_known = self.peers_known or ready

    def started(self, episodes: int) -> None:
        """A group of ``episodes`` began (counted against the synchronous batch)."""
        self._sync_started += episodes

    def may_start(
        self, *, in_flight: int, sent: int, version: int, announced_version: int | None
    ) -> bool:
        """May a new group start now? ``in_flight``: this producer's episodes in flight;
        ``sent``: its records written; ``version``: the policy version it samples with;
        ``announced_version``: the newest version announced (None: no weights topic)."""
        if self.sync_batch is not None:
            if version != self._sync_version:
                self._sync_version, self._sync_started = version, 0
            self.waiting = self._sync_started >= self.sync_batch
            return not self.waiting
        if self.max_staleness < 0:
            return True
        if not self.peers_known:
            return False
        # Versions the trainer is ahead of the weights sampled here (one is loading, or
        # could not be) make an episode started now that much older when trained.
        behind = 0 if announced_version is None else max(0, announced_version - version)
        self.behind = behind
        d = decide(
            budget=max(0, self.max_staleness - behind) * self.trainer_batch,
            group_size=self.group_size,
            lag=self.lag,
            # The polled lag counts the records Kafka held when the poll began: those this
            # producer wrote that were not acknowledged by then count too (a record written
            # is not in the high watermark until the cluster acknowledges it), or a slow
            # poll or a slow broker would let it start groups on a low figure.
            unpolled=sent - self.settled_at_poll + self.peers_unpolled,
            own_in_flight=in_flight,
            peers=self.peers,
            announced=self.announced if self.rounds_known < JOIN_ROUNDS else None,
        )
        self.share = d.share
        now = self.clock()
        if d.cause != self._cause:
            if self._cause:
                self._paused_by[self._cause] = (
                    self._paused_by.get(self._cause, 0.0) + now - self._cause_since
                )
            self._cause, self._cause_since = d.cause, now
        self.paused = not d.admit
        return d.admit

    def paused_by(self) -> dict[str, float]:
        """Seconds admission has held new groups back so far, by cause (:data:`CAUSES`),
        the pause under way included."""
        out = {cause: self._paused_by.get(cause, 0.0) for cause in CAUSES}
        if self._cause:
            out[self._cause] += self.clock() - self._cause_since
        return out
