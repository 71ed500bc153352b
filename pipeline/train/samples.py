"""A trainer's figures for Prometheus, read from the trainer at scrape time."""

from __future__ import annotations

import time
from typing import Any

from pipeline.observe.prometheus import Sample


def trainer_samples(t: Any) -> list[Sample]:
    """The figures of trainer ``t`` (a :class:`~pipeline.train.trainer.Trainer`)."""
    m = t.last_metrics
    out = [
        Sample("rlstream_trainer_step", int(t.state.step), help="train steps taken"),
        Sample("rlstream_trainer_policy_version", t.version, help="latest policy version"),
        Sample(
            "rlstream_trainer_trained_total",
            t.trained,
            "counter",
            "samples trained by this process",
        ),
        Sample(
            "rlstream_trainer_samples_per_second",
            t.trained / max(1e-9, time.monotonic() - t.started_at),
            help="samples trained per second since start",
        ),
        Sample(
            "rlstream_trainer_deadlettered_total",
            t.deadlettered,
            "counter",
            "records sent to the dead-letter topic",
        ),
        Sample(
            "rlstream_trainer_deadletter_failures_total",
            t.deadletter_failures,
            "counter",
            "dead letters the client refused or Kafka did not take (records still settled)",
        ),
        Sample(
            "rlstream_trainer_nonfinite_steps_total",
            t.nonfinite_steps,
            "counter",
            "steps not applied because their loss or gradients were not finite",
        ),
    ]
    out += [
        Sample(
            "rlstream_trainer_dropped_total",
            n,
            "counter",
            "records dropped, by reason (stale, stale_range, deadletter, ...)",
            {"reason": reason},
        )
        for reason, n in sorted(dict(t.drops).items())
    ]
    for key, name, text in (
        ("lag", "rlstream_trainer_lag_records", "records not trained or dropped yet"),
        ("staleness_mean", "rlstream_trainer_staleness_mean", "last batch's mean staleness"),
        ("busy_share", "rlstream_trainer_busy_share", "share of time spent training"),
        ("loss", "rlstream_trainer_loss", "last step's loss"),
    ):
        if key in m:
            out.append(Sample(name, float(m[key]), help=text))
    for key, name in (
        ("reward", "rlstream_trainer_reward"),
        ("success", "rlstream_trainer_success"),
    ):
        out += [
            Sample(name, v, help=f"last batch's mean {key}, by environment", labels={"env": e})
            for e, v in sorted(m.get(key, {}).items())
        ]
    return out
