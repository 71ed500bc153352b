"""Child processes of a run: start them, watch them, stop them, leave none behind.

Each child is an ``rlstream`` command in its own session (so a terminal's Ctrl-C reaches
the supervisor only, which stops the children in order), with its output in a log file.
Stopping sends SIGTERM, waits ``grace_s``, then kills what is left, with its whole process
group.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.kafka.local_service import stop_with_parent

log = logging.getLogger(__name__)


@dataclass
class Child:
    """One ``rlstream`` sub-command run as a separate OS process."""

    name: str
    args: Sequence[str]
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    returncode: int | None = None

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "pipeline.cli", *self.args]

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            out.write(f"==== {time.strftime('%H:%M:%S')} start: {' '.join(self.args)}\n".encode())
            self.proc = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                start_new_session=True,
                preexec_fn=functools.partial(stop_with_parent, os.getpid()),
            )
        self.started_at = time.monotonic()
        self.returncode = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        if self.proc is not None and self.returncode is None:
            self.returncode = self.proc.poll()
        return self.returncode

    def running(self) -> bool:
        return self.proc is not None and self.poll() is None

    def signal(self, sig: int) -> None:
        if self.running():
            assert self.proc is not None
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])


class Supervisor:
    """Starts children, reports the first one that failed, stops them all."""

    def __init__(self, children: Sequence[Child]) -> None:
        self.children = list(children)

    def start(self) -> None:
        for c in self.children:
            c.start()
            log.debug("started %s pid=%s", c.name, c.pid)

    def failed(self) -> Child | None:
        """A child that exited with a non-zero status."""
        for c in self.children:
            rc = c.poll()
            if rc not in (None, 0):
                return c
        return None

    def stop(self, children: Sequence[Child] | None = None, grace_s: float = 60.0) -> None:
        """SIGTERM, wait up to ``grace_s`` for a clean exit, then SIGKILL the group."""
        targets = [c for c in (children or self.children) if c.running()]
        for c in targets:
            c.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(c.running() for c in targets) and time.monotonic() < deadline:
            time.sleep(0.1)
        for c in targets:
            if c.running():
                log.warning("%s did not stop within %.0fs: killed", c.name, grace_s)
                c.signal(signal.SIGKILL)
                assert c.proc is not None
                c.proc.wait(10)
                c.poll()
        for c in children or self.children:
            # a child's own helpers (same session) may outlive it: kill the group
            if c.proc is not None:
                try:
                    os.killpg(c.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
