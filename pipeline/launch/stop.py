"""A stop flag set by SIGINT or SIGTERM, which long-running loops check to wind down."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any


class StopFlag:
    """Set by SIGINT/SIGTERM; long-running loops check it and wind down cleanly. A second
    signal stops at once (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal: int | None = None

    def install(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.event.is_set():  # second signal: stop now
            raise KeyboardInterrupt
        self.signal = signum
        self.event.set()
        print(f"\nstopping ({signal.Signals(signum).name}); again to force", file=sys.stderr)

    def __bool__(self) -> bool:
        return self.event.is_set()


#: the flag of the command this process runs (see :func:`begin`)
_process: StopFlag | None = None


def begin() -> tuple[StopFlag, Callable[[], None]]:
    """A new stop flag for the command this process runs, installed, and a function that
    puts back the handlers it replaced. The command line calls it before it imports
    anything else: a process needs seconds to start (JAX to load), and a signal in that
    time, which would have killed it, is kept, so that the command stops cleanly once it
    runs. (A trainer group member killed while starting left the others waiting for it
    to join, five minutes.)"""
    global _process
    _process = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        return _process, lambda: None  # (signals reach the main thread only)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    _process.install()

    def restore() -> None:
        for sig, handler in before.items():
            signal.signal(sig, handler)

    return _process, restore


def process_flag() -> StopFlag:
    """The command's stop flag (the one :func:`begin` made; a new one where nothing
    called it, as when a command's function is called in-process), installed again
    (joining a JAX job installs JAX's own SIGTERM handler)."""
    global _process
    if _process is None:
        _process = StopFlag()
    return _process.install()
