"""Parent side: watch started children: pump their output and messages, decode how they ended, stop them.

One Watcher holds any number of children on one selector: `distributed.run` watches all its ranks
with one, a job supervisor one job. Each child's pidfd is on the selector too, so an exit wakes the
watcher at once. Output is forwarded line by line through a callback and its last lines are kept
for failure reports. `stop` is the one way children end early: SIGTERM to each child's process
group, `grace` seconds to finish (a user's SIGTERM handler can save a checkpoint), then SIGKILL to
the whole group, grandchildren that ignore SIGTERM included. `exit_on_terminate` makes a SIGTERM or
SIGHUP sent to this process go the same way, instead of killing it before it could stop them.
"""

from __future__ import annotations

import collections
import contextlib
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType

from levers9.procs import fds
from levers9.procs.failure import Failure, FrameReader

TAIL_LINES = 400  # kept per child for failure reports


class Child:
    """A started child: its pid, pipes, the last lines it printed, what it sent back and how it ended."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None, msg_fd: int, out_fd: int, err_fd: int, name: str) -> None:
        self.pid, self.popen, self.name = pid, popen, name
        self.msg_fd, self.out_fd, self.err_fd = msg_fd, out_fd, err_fd
        self.reader = FrameReader()
        self.partial: dict[int, bytes] = {}
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.status: tuple[int | None, int | None] | None = None  # (exit code, signal) once reaped
        self.reported = False  # a "result" or "error" message arrived
        self.result: bytes | None = None
        self.failure: Failure | None = None
        try:
            self.pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self.pidfd = None

    def poll(self) -> bool:
        """Reap the child if it has exited; True once it has."""
        if self.status is not None:
            return True
        try:
            pid, raw = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            self.status = (None, None)
            return True
        if pid == 0:
            return False
        code = os.waitstatus_to_exitcode(raw)
        if self.popen is not None:
            self.popen.returncode = code  # reaped here: the Popen must not wait for it again
        self.status = (code, None) if code >= 0 else (None, -code)
        return True

    @property
    def failed(self) -> bool:
        """It reported a failure, or ended with anything but exit code 0."""
        return self.failure is not None or (self.status is not None and self.status != (0, None))

    @property
    def exitcode(self) -> int | None:
        return None if self.status is None else self.status[0]

    @property
    def signal(self) -> int | None:
        return None if self.status is None else self.status[1]

    def signal_tree(self, signum: int) -> None:
        """Send `signum` to the child's process group (everything it started), or to the child alone
        while it has not made its group yet."""
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signum)


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (one of another user's counts: it cannot be signalled, but it lives)."""
    if pid <= 0:
        return False
    try:
        with contextlib.suppress(PermissionError):
            os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def exit_on_terminate() -> Iterator[None]:
    """While this block waits for children in the main thread: SIGTERM or SIGHUP, which by default kill this
    process at once (its children then die by SIGKILL with it), raise SystemExit(128 + signal) instead, so the
    waiting code stops its children with their grace period first and a child's own SIGTERM handler can save
    a checkpoint (torchrun's agent does the same). A handler the caller installed is left in place; outside
    the main thread, where Python runs no signal handler, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    replaced = {signum: signal.signal(signum, _exit_for_signal) for signum in TERMINATING_SIGNALS
                if signal.getsignal(signum) is signal.SIG_DFL}  # fmt: skip
    try:
        yield
    finally:
        for signum, handler in replaced.items():
            signal.signal(signum, handler)


def _exit_for_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


LineSink = Callable[[Child, str, str], None]  # (child, "stdout" or "stderr", line without its newline)


class Watcher:
    """Children on one selector: their output goes to `on_line`, their messages to the Child."""

    def __init__(self, on_line: LineSink) -> None:
        self.on_line = on_line
        self.children: list[Child] = []
        self.selector = selectors.DefaultSelector()

    def add(self, child: Child) -> Child:
        self.children.append(child)
        for fd in (child.msg_fd, child.out_fd, child.err_fd):
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, child)
        if child.pidfd is not None:
            self.selector.register(child.pidfd, selectors.EVENT_READ, child)
        return child

    def pump(self, wait: float) -> None:
        """Wait up to `wait` s for anything to happen; read whatever is ready; reap children that ended."""
        for key, _ in self.selector.select(wait):
            child: Child = key.data
            if key.fd == child.pidfd:
                self._forget(key.fd)
                child.pidfd = None
                continue
            try:
                chunk = os.read(key.fd, 1 << 20)
            except BlockingIOError:
                continue
            if not chunk:
                self._forget(key.fd)
                if key.fd != child.msg_fd:
                    self._emit(child, key.fd, child.partial.pop(key.fd, b""), final=True)
            elif key.fd == child.msg_fd:
                for kind, value in child.reader.feed(chunk):
                    child.reported = True
                    child.result, child.failure = (value, None) if kind == "result" else (None, value)
            else:
                self._emit(child, key.fd, child.partial.pop(key.fd, b"") + chunk, final=False)
        for child in self.children:
            child.poll()

    def _forget(self, fd: int) -> None:
        self.selector.unregister(fd)
        if fds.is_tracked(fd):
            fds.close(fd)
        else:
            os.close(fd)

    def _emit(self, child: Child, fd: int, data: bytes, *, final: bool) -> None:
        if not data:
            return
        lines = data.split(b"\n")
        if not final:
            rest = lines.pop()
            if rest:
                child.partial[fd] = rest
        elif lines[-1] == b"":
            lines.pop()
        stream = "stdout" if fd == child.out_fd else "stderr"
        for raw in lines:
            line = raw.decode("utf-8", errors="replace")
            child.tail.append(line)
            self.on_line(child, stream, line)

    def drain(self, seconds: float = 0.5) -> None:
        """Read what is left in the pipes (output written just before exiting), for at most `seconds`."""
        end = time.monotonic() + seconds
        while self._open_pipes() and time.monotonic() < end:
            self.pump(0.02)

    def _open_pipes(self) -> bool:
        return any(key.fd != key.data.pidfd for key in self.selector.get_map().values())

    def wait(self, children: Iterable[Child], timeout: float | None) -> bool:
        """Pump until every child in `children` has ended; False if `timeout` s passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        pending = [c for c in children if not c.poll()]
        while pending:
            left = 0.05 if end is None else min(0.05, end - time.monotonic())
            if left <= 0:
                return False
            self.pump(left)
            pending = [c for c in pending if not c.poll()]
        return True

    def stop(self, grace: float) -> None:
        """SIGTERM every live child's process group, SIGKILL after `grace` s, reap them all, and SIGKILL
        whatever is left in their groups (grandchildren that ignored SIGTERM)."""
        live = [c for c in self.children if not c.poll()]
        for child in live:
            child.signal_tree(signal.SIGTERM)
        if not self.wait(live, grace):
            for child in live:
                if not child.poll():
                    child.signal_tree(signal.SIGKILL)
            self.wait(live, None)
        for child in self.children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)

    def close(self) -> None:
        """Close every pipe still open; the selector is unusable afterwards."""
        for key in list(self.selector.get_map().values()):
            self._forget(key.fd)
        self.selector.close()
