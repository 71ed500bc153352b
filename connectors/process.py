"""The ``process`` connector: an environment in a child process speaking the remote
protocol as JSON lines over stdin/stdout (``rlstream env serve NAME --stdio`` is one such
child; any program in any language can be another).

``--env process --env-option 'command=my-env --flag' --env-option name=myenv``

Each episode holds one child for its whole length (one child per episode slot, reused by
the slot's next episode). The command is split like a shell would but never run by one.
A child that dies is replaced by a fresh one (a reset is tried again on it; a step is
not, its state is gone: ``env_error``); a child that does not answer within
``call_timeout_s`` is killed with its process group (``timeout``); a child that writes
something that is not an answer (not JSON, too long, the wrong id) is killed
(``env_error``). Counted in :mod:`connectors.stats` as ``process/<reason>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import shlex
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from connectors import protocol
from connectors.base import Environment, SeedTask, Step, Task, shared
from connectors.stats import count
from pipeline.errors import InvalidConfigError

log = logging.getLogger(__name__)


class ChildDied(protocol.ConnectorError):
    def __init__(self, message: str) -> None:
        super().__init__("died", message)


class ServerProcess:
    """One child process and its request/answer stream."""

    def __init__(self, proc: asyncio.subprocess.Process, max_line_bytes: int) -> None:
        self.proc = proc
        self.max_line_bytes = max_line_bytes
        self._next_id = 0
        self.killed = False

    @property
    def alive(self) -> bool:
        return not self.killed and self.proc.returncode is None

    async def request(self, op: str, body: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._next_id += 1
        rid = self._next_id
        line = protocol.encode({**body, "op": op, "id": rid}) + b"\n"
        try:
            self.proc.stdin.write(line)
            await asyncio.wait_for(self.proc.stdin.drain(), timeout_s)
            answer = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        except TimeoutError:
            count("process", "hung")
            await self.kill()
            raise TimeoutError(f"child {self.proc.pid} gave no answer in {timeout_s:g} s") from None
        except asyncio.CancelledError:  # (the episode's deadline) the stream is out of step
            count("process", "abandoned")
            self._signal_kill()
            raise
        except (BrokenPipeError, ConnectionResetError):
            answer = b""
        except ValueError:  # a line longer than the stream limit
            count("process", "oversized")
            await self.kill()
            raise protocol.ConnectorError(
                "oversized", f"child {self.proc.pid} wrote a line over {self.max_line_bytes} bytes"
            ) from None
        if not answer:
            count("process", "died")
            await self.kill()
            raise ChildDied(f"child {self.proc.pid} exited ({self.proc.returncode})")
        try:
            msg = protocol.decode(answer, self.max_line_bytes)
            if msg.get("id") != rid:
                raise protocol.ConnectorError("malformed", f"answer id {msg.get('id')!r} != {rid}")
        except protocol.ConnectorError as e:
            count("process", "garbage")
            await self.kill()
            raise protocol.ConnectorError("garbage", f"child {self.proc.pid}: {e}") from None
        protocol.raise_if_error(msg)
        return msg

    def _signal_kill(self) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.killed = True

    async def kill(self) -> None:
        """SIGKILL the child's process group (it runs in its own session) and reap it."""
        self._signal_kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.proc.wait(), 5)


class ServerProcessPool:
    """Idle children of one command, shared by the episodes of a producer."""

    def __init__(self, argv: Sequence[str], max_line_bytes: int, cwd: str | None) -> None:
        self.argv, self.max_line_bytes, self.cwd = list(argv), max_line_bytes, cwd
        self.idle: list[ServerProcess] = []
        self.busy: set[ServerProcess] = set()

    async def acquire(self) -> ServerProcess:
        while self.idle:
            child = self.idle.pop()
            if child.alive:
                self.busy.add(child)
                return child
            count("process", "died")
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                limit=self.max_line_bytes + 1,
                start_new_session=True,
                cwd=self.cwd,
            )
        except OSError as e:
            count("process", "spawn_failed")
            raise protocol.ConnectorError("spawn_failed", f"{self.argv[0]}: {e}") from None
        count("process", "started")
        child = ServerProcess(proc, self.max_line_bytes)
        self.busy.add(child)
        return child

    async def release(self, child: ServerProcess, healthy: bool = True) -> None:
        """Back to the idle children, or killed and reaped when dead or not ``healthy``."""
        self.busy.discard(child)
        if healthy and child.alive:
            self.idle.append(child)
        else:
            await child.kill()

    async def aclose(self) -> None:
        for child in [*self.idle, *self.busy]:
            if child.proc.stdin is not None:
                child.proc.stdin.close()  # a well-behaved child exits on end of input
        for child in [*self.idle, *self.busy]:
            try:
                await asyncio.wait_for(child.proc.wait(), 2)
            except TimeoutError:
                await child.kill()
        self.idle.clear()
        self.busy.clear()


class ProcessEnvironment(Environment):
    """An environment in a child process; ``name`` is the one its trajectories carry."""

    name = "process"  # (the ``name`` option overrides it)

    def __init__(
        self,
        command: str | Sequence[str],
        name: str = "process",
        call_timeout_s: float = 10.0,
        max_line_bytes: int = protocol.MAX_MESSAGE_BYTES,
        cwd: str | None = None,
    ) -> None:
        argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        if not argv:
            raise InvalidConfigError("the process connector needs a command")
        if call_timeout_s <= 0:
            raise InvalidConfigError("call_timeout_s must be positive")
        self.argv, self.name = argv, name
        self.call_timeout_s, self.max_line_bytes, self.cwd = call_timeout_s, max_line_bytes, cwd
        self._child: ServerProcess | None = None
        self._session = ""
        self._seq = 0

    def sample_task(self, rng: random.Random) -> Task:
        return SeedTask.draw(rng)

    def _pool(self) -> ServerProcessPool:
        key = ("process", tuple(self.argv), self.max_line_bytes, self.cwd)
        return shared(key, lambda: ServerProcessPool(self.argv, self.max_line_bytes, self.cwd))

    async def reset(self, task: Task) -> str:
        self._session = os.urandom(8).hex()
        self._seq = 0
        body = {"session": self._session, **protocol.task_message(task)}
        for attempt in range(2):  # nothing has happened yet: a dead child is replaced once
            if self._child is None:
                self._child = await self._pool().acquire()
            try:
                msg = await self._child.request("reset", body, self.call_timeout_s)
                return protocol.text(msg, "observation")
            except ChildDied:
                await self._drop()
                if attempt:
                    raise
                count("process", "restart")
        raise AssertionError("unreachable")

    async def step(self, action: str) -> Step:
        self._seq += 1
        msg = await self._request("step", {"seq": self._seq, "action": action})
        return protocol.step_of(msg)

    async def call_tool(self, name: str, arguments: str) -> str:
        self._seq += 1
        try:
            body = {"seq": self._seq, "name": name, "arguments": arguments}
            msg = await self._request("tool", body)
        except protocol.RemoteError as e:
            if e.code == "no_such_tool":
                raise KeyError(name) from None
            raise
        return protocol.text(msg, "result")

    async def _request(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._child is None:
            raise protocol.ConnectorError("no_session", "the episode has no child (reset first)")
        try:
            return await self._child.request(
                op, {"session": self._session, **body}, self.call_timeout_s
            )
        except (TimeoutError, protocol.ConnectorError) as e:
            if not isinstance(e, protocol.RemoteError):
                await self._drop()
            raise

    async def close(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        try:
            if child.alive:
                await child.request("close", {"session": self._session}, self.call_timeout_s)
        except (TimeoutError, protocol.ConnectorError):
            pass  # the child was killed; the pool replaces it
        finally:
            await self._pool().release(child)

    async def _drop(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            await self._pool().release(child, healthy=False)
