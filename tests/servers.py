"""Servers tests start as child processes: on a free port, waited for, always stopped."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(argv: Callable[[int], list[str]], wait_s: float = 90) -> Iterator[int]:
    """``python argv(port)`` run from the repository until the port answers; the port.
    Stopped at the end (killed when it does not stop: a request may still be asleep)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, *argv(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"{argv(port)} exited {proc.returncode}") from None
                time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
