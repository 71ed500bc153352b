"""What the local Java services rlstream runs (Kafka, a schema registry) share: a state
file in their data directory that ``stop`` and ``status`` read from another process, and
the handling of their processes."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class LocalService:
    """A service whose state (pids, ports, address) lives in ``data_dir/state_file``."""

    def __init__(self, data_dir: Path, state_file: str) -> None:
        self.data_dir = data_dir.resolve()
        self.state_path = self.data_dir / state_file

    def state(self) -> dict[str, Any] | None:
        """The recorded state of a service started from this data dir, or None."""
        try:
            return dict(json.loads(self.state_path.read_text()))
        except (OSError, ValueError):
            return None

    def pids(self, state: dict[str, Any]) -> list[int]:
        """The processes a recorded state names."""
        raise NotImplementedError

    def running(self) -> bool:
        """Whether every process of the recorded state is alive."""
        state = self.state()
        if not state:
            return False
        return all(alive(p) for p in self.pids(state))


def stop_with_parent(parent: int) -> None:
    """In a child process before exec (``preexec_fn``): on Linux, get SIGTERM when the
    process that started it dies, even by SIGKILL, so that it does not outlive it; a
    parent that died before this ran (the signal would never come) ends the child."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return True


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def send_signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def reap(pids: list[int]) -> None:
    """Collect exited children of this process so they do not linger as zombies."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def terminate(pids: list[int], grace_s: float, what: str) -> list[int]:
    """Stop processes: SIGTERM, then SIGKILL for those still alive after ``grace_s``
    seconds (logged, naming ``what``). Returns the pids that were alive."""
    pids = [p for p in pids if alive(p)]
    for pid in pids:
        send_signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        if alive(pid):
            log.warning("%s pid=%d did not stop in %.0fs, killing", what, pid, grace_s)
            send_signal(pid, signal.SIGKILL)
    reap(pids)
    return pids
