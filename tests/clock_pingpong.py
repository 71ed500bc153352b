"""One side of a ping-pong between two processes, for the clock-ordering test.

``python -m tests.clock_pingpong NAME NAMESPACE ROUNDS [--first]``: each round waits for a
line on stdin (the first player starts at once), records a span ``turn`` (with its round)
around a short piece of work, then writes a line to stdout. The test relays one player's
stdout to the other's stdin, so every turn of one process truly ends before the other's
next turn starts; the spans go to ``<ns>.telemetry`` through the real tracer.
"""

from __future__ import annotations

import os
import sys
import time

from pipeline.kafka.client import KafkaConfig
from pipeline.observe.shipping import kafka_tracer
from pipeline.observe.telemetry import install, span


def main() -> None:
    name, namespace, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    first = "--first" in sys.argv
    tracer = install(
        kafka_tracer(name, KafkaConfig(bootstrap=os.environ["RLSTREAM_BOOTSTRAP"]), namespace)
    )
    for i in range(rounds):
        if i > 0 or not first:
            if not sys.stdin.readline():
                break
        with span("turn", round=i):
            time.sleep(0.002)
        print(i, flush=True)
    tracer.close()


if __name__ == "__main__":
    main()
