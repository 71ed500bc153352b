"""The trainer group as one JAX job: ``members`` processes, one mesh over all their devices.

Each member is a process of one ``jax.distributed`` job (member 0 serves the
coordinator; on CPU the collectives run over gloo) and a member of the Kafka consumer
group ``<ns>.trainer``, reading its own partitions. Every step is one SPMD step over the
global batch: each member contributes the rows of its own groups
(``jax.make_array_from_process_local_data``). Before every step the members agree
(:meth:`Members.agree`, an all-gather of a few integers): whether to step, how long the
batch is, whether to checkpoint or stop. So no member waits forever on another whose
partitions ran dry (the batch timeout gives it padding rows), and the local batches of a
step always have one shape.

With one member nothing here runs a collective: the trainer is the single process it
always was.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any

import jax
import numpy as np

from pipeline.errors import InvalidConfigError, RlstreamError

log = logging.getLogger(__name__)

#: seconds a member waits at start for every other member to join
JOIN_TIMEOUT_S = 300
#: the exit status of a member its watchdog ended (a stalled group)
STALLED_EXIT = 75


def free_coordinator() -> str:
    """A loopback address for a trainer group's coordinator, on a port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class Members:
    """This process's place in the trainer group."""

    def __init__(self, members: int, index: int, coordinator: str) -> None:
        self.count, self.index, self.coordinator = members, index, coordinator
        if members == 1:
            return
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        log.info(
            "joining trainer group member=%d of %d at %s (waiting up to %d s for the others)",
            index,
            members,
            coordinator,
            JOIN_TIMEOUT_S,
        )
        try:
            jax.distributed.initialize(
                coordinator,
                num_processes=members,
                process_id=index,
                initialization_timeout=JOIN_TIMEOUT_S,
                # the service listens on the address given (loopback by default), not on
                # every interface as JAX would: it has no authentication
                coordinator_bind_address=os.environ.get(
                    "JAX_COORDINATOR_BIND_ADDRESS", coordinator
                ),
            )
        except RuntimeError as e:
            raise RlstreamError(
                f"trainer member {index} of {members} could not join the group at "
                f"{coordinator} (member 0 serves it; all members must start within "
                f"{JOIN_TIMEOUT_S} s and JAX must not be in use yet): {str(e)[:300]}"
            ) from None
        log.info(
            "joined trainer group member=%d of %d devices=%d local=%d",
            index,
            members,
            jax.device_count(),
            jax.local_device_count(),
        )

    @property
    def many(self) -> bool:
        return self.count > 1

    @property
    def lead(self) -> bool:
        """Member 0: it announces weights and writes the group's checkpoint metadata."""
        return self.index == 0

    def check_mesh(self, mesh: Any) -> None:
        """A group's mesh spans every member's devices, each member holding whole rows
        of the fsdp axis (its part of the batch)."""
        if not self.many:
            return
        if mesh.devices.size != jax.device_count():
            raise InvalidConfigError(
                f"a trainer group of {self.count} members trains over all "
                f"{jax.device_count()} of their devices: set fsdp x tensor_parallel to "
                f"{jax.device_count()} (fsdp 0 takes every device), not "
                f"{mesh.shape['fsdp']} x {mesh.shape['tensor']}"
            )
        if jax.local_device_count() % mesh.shape["tensor"]:
            raise InvalidConfigError(
                f"tensor_parallel {mesh.shape['tensor']} must divide each member's "
                f"{jax.local_device_count()} devices"
            )

    def agree(self, local: list[int]) -> np.ndarray:
        """Every member's ``local`` figures, ``[members, len(local)]`` (a collective:
        every member calls it at the same point)."""
        mine = np.asarray(local, np.int64)[None]
        if not self.many:
            return mine
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(mine, tiled=True))

    def gather_json(self, obj: Any) -> list[Any]:
        """Every member's ``obj`` (JSON), in member order (a collective)."""
        if not self.many:
            return [obj]
        data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
        size = int(self.agree([len(data)])[:, 0].max())
        padded = np.zeros(size, np.uint8)
        padded[: len(data)] = data
        from jax.experimental import multihost_utils

        rows = np.asarray(multihost_utils.process_allgather(padded[None], tiled=True))
        return [json.loads(bytes(r).rstrip(b"\0")) for r in rows]

    def put(self, tree: Any, shardings: Any) -> Any:
        """``tree`` (the same values on every member) as global arrays of ``shardings``."""
        if not self.many:
            return jax.device_put(tree, shardings)
        host = jax.device_get(tree)
        return jax.tree.map(
            lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda i: np.asarray(x)[i]),
            host,
            shardings,
        )

    def batch(self, local: Any, sharding: Any) -> Any:
        """The global batch from this member's rows (its part, in member order)."""
        if not self.many:
            return local
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), local
        )

    def host(self, tree: Any) -> Any:
        """``tree``'s global arrays whole on every member, as numpy (a collective)."""
        if not self.many:
            return tree
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)


class Watchdog:
    """Ends this member when its loop has not come round for ``timeout_s``.

    A collective waits for every member, with no timeout of its own: a member that
    stopped answering (stopped, swapped out, stuck in a collective the others never
    entered) would hold the whole group forever, silently. The watchdog turns that into
    an exit with a sentence (status :data:`STALLED_EXIT`), which ``rlstream run``
    answers as it answers a crash: it restarts the group from its last checkpoint,
    where the ledger makes the work done since count once. An exit as abrupt as a
    SIGKILL, which the checkpoint protocol already survives."""

    def __init__(self, timeout_s: float, where: str) -> None:
        self.timeout_s, self.where = timeout_s, where
        self.doing = "starting"
        self._last = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    def beat(self, doing: str) -> None:
        """The loop came round; ``doing`` names what it does next (for the sentence)."""
        self._last, self.doing = time.monotonic(), doing

    def close(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(5.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                log.error(
                    "%s made no progress for %.0f s (stall_timeout_s %.0f) while %s: a "
                    "member stopped answering or a collective never completed; exiting "
                    "so that the group restarts from its last checkpoint",
                    self.where,
                    idle,
                    self.timeout_s,
                    self.doing,
                )
                logging.shutdown()
                os._exit(STALLED_EXIT)
