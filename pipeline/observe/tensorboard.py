"""TensorBoard scalars of a run, written with tensorboardX (no TensorFlow needed).

:class:`ScalarWriter` appends each row of scalars as one ``Event`` (tensorboardX's
protobuf and record writer, used synchronously: its ``SummaryWriter`` queues events on a
thread, and a flush there does not wait for them) and flushes it, so a crashed process
loses nothing it reported; a restarted process writes a second event file into the same
folder, as TensorBoard expects. The test suite reads the files back with TensorBoard's
own reader.

Point TensorBoard at a run directory's ``tensorboard/`` folder:
``tensorboard --logdir runs/<run>/tensorboard``.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.summary import scalar


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numbers of a (nested) metrics row as ``prefix/key[/sub]`` tags; booleans, strings
    and non-finite values are left out."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        tag = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, tag))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            if float(v) == float(v) and abs(float(v)) != float("inf"):
                out[tag] = float(v)
    return out


_WRITERS = itertools.count()


class ScalarWriter:
    """Appends scalars to a new event file in ``logdir`` (one file per writer: a
    restarted process starts a second file in the same folder)."""

    def __init__(self, logdir: Path) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        self._writer = EventsWriter(
            str(logdir / "events"), filename_suffix=f".{os.getpid()}.{next(_WRITERS)}"
        )
        self._writer.flush()
        self.path = Path(self._writer._file_name)

    def write(
        self, step: int, scalars: Mapping[str, float], wall_time: float | None = None
    ) -> None:
        if not scalars:
            return
        summary = Summary(value=[v for tag, x in scalars.items() for v in scalar(tag, x).value])
        event = Event(
            wall_time=time.time() if wall_time is None else wall_time, step=step, summary=summary
        )
        self._writer.write_event(event)
        self._writer.flush()  # each step's event whole, and on disk at once

    def close(self) -> None:
        self._writer.close()
