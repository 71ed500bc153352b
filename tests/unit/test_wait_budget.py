"""The wind-down's waits on the cluster: one budget shared by all of them, and a close
that does not wait past it."""

from __future__ import annotations

import threading
import time

from pipeline.kafka.client import WaitBudget, close_within


class _Client:
    def __init__(self, blocks_for: float = 0.0, fails: bool = False) -> None:
        self.blocks_for, self.fails = blocks_for, fails
        self.closed = threading.Event()

    def close(self) -> None:
        time.sleep(self.blocks_for)
        self.closed.set()
        if self.fails:
            raise RuntimeError("Consumer closed")


def test_a_budget_is_shared_by_its_waits_and_never_negative() -> None:
    budget = WaitBudget(0.3)
    assert 0.2 < budget.left() <= 0.3
    assert budget.left(0.05) == 0.05
    time.sleep(0.35)
    assert budget.left() == 0.0 and budget.left(5) == 0.0
    assert WaitBudget(-1).left() == 0.0


def test_a_close_that_hangs_is_left_to_its_thread_after_the_time_given() -> None:
    hangs = _Client(blocks_for=5)
    t0 = time.monotonic()
    assert close_within(hangs, 0.2, "consumer") is False
    assert time.monotonic() - t0 < 1.0 and not hangs.closed.is_set()


def test_a_prompt_close_and_a_failing_one_are_done_within_the_time() -> None:
    prompt = _Client()
    assert close_within(prompt, 2, "consumer") is True and prompt.closed.is_set()
    failing = _Client(fails=True)  # (already closed: confluent-kafka raises RuntimeError)
    assert close_within(failing, 2, "consumer") is True and failing.closed.is_set()
