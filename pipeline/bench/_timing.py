"""Side-by-side timing: contenders measured in interleaved rounds, median reported."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def rates(
    contenders: Mapping[str, Callable[[], object]], seconds: float, rounds: int
) -> dict[str, float]:
    """Operations per second of each contender: ``rounds`` interleaved rounds of about
    ``seconds`` each, median of the rounds (so drift of the machine hits all alike)."""
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for fn in contenders.values():  # warm-up
        fn()
    for _ in range(rounds):
        for name, fn in contenders.items():
            n = 0
            start = time.perf_counter()
            deadline = start + seconds
            while True:
                fn()
                n += 1
                now = time.perf_counter()
                if now >= deadline:
                    break
            samples[name].append(n / (now - start))
    return {name: statistics.median(v) for name, v in samples.items()}
