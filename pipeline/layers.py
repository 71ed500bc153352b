"""The layers of rlstream, lowest first: a module may import modules of its own layer and
of the layers below it, never above. ``tests/unit/test_layers.py`` reads every import of
``pipeline`` and ``connectors`` and fails on one against this list, or on a module the
list does not place. A name stands for a module and everything below it; the longest
name that matches places a module.

The order is the data flow's: records and instrumentation at the bottom (every part
writes records and spans), the policy, Kafka I/O, environments, then the two processes
(rollout producers and trainers) above them, what reads a run back (reports, profiles)
above those, then whole pipelines and benchmarks, and the command line on top.
"""

from __future__ import annotations

LAYERS: tuple[tuple[str, ...], ...] = (
    # the exception root, configuration, records and their schemas
    (
        "pipeline",
        "pipeline.errors",
        "pipeline.config_file",
        "pipeline.settings",
        "pipeline.compile_cache",
        "pipeline.layers",
        "pipeline.schemas",
        "pipeline.records",
    ),
    # instrumentation every layer may use: spans and metrics, their exporters
    (
        "pipeline.observe.telemetry",
        "pipeline.observe.prometheus",
        "pipeline.observe.tensorboard",
        "pipeline.observe.provenance",
    ),
    # the policy: model, tokenizers, sampling, checkpoints
    ("pipeline.policy",),
    # Kafka: clients, topics, transport, weights announcements, recordings, local services
    ("pipeline.kafka", "pipeline.kafka_runtime"),
    # environments and their connectors; test doubles of records and policies
    ("connectors", "pipeline.testing"),
    # the two kinds of process
    ("pipeline.rollout", "pipeline.train"),
    # what reads a run back: profiles, reports, plots, episodes, recordings
    ("pipeline.observe",),
    # whole pipelines on one machine, and benchmarks
    ("pipeline.launch", "pipeline.bench"),
    # the command line
    ("pipeline.cli",),
)


def layer_of(module: str) -> int | None:
    """The layer of ``module`` (a dotted name), or None when the list places none of it."""
    best: tuple[int, int] | None = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if module == name or (module.startswith(name + ".") and name != "pipeline"):
                if best is None or len(name) > best[1]:
                    best = (i, len(name))
    return None if best is None else best[0]
