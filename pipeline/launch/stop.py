"""A stop flag set by SIGINT or SIGTERM, which long-running loops check to wind down."""

from __future__ import annotations

import signal
import sys
import threading
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
