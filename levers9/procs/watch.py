"""Parent side: watch started children: pump their output and messages, decode how they ended, stop them.

One Watcher holds any number of children on one selector: `distributed.run` watches all its ranks
with one, a job supervisor one job. Each child's pidfd is on the selector too, so an exit wakes the
watcher at once. Output is forwarded line by line through a callback, called on a thread of its own
(lines.py: the watcher never blocks on a caller's stream), and its last lines are kept for failure
reports. `stop` is the one way children end early: SIGTERM to each child's process
group, `grace` seconds to finish (a user's SIGTERM handler can save a checkpoint), then SIGKILL to
the whole group, grandchildren that ignore SIGTERM included. `exit_on_terminate` makes a SIGTERM or
SIGHUP sent to this process go the same way, instead of killing it before it could stop them.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType

from levers9.procs import echo, fds, lines
from levers9.procs.failure import FailureRecord, FrameReader

TAIL_LINES = 400  # kept per child for failure reports
REPORT_LINES = 40  # of a child's last output, shown in a failure report
TAIL_LINE_CHARS = 4000  # of each of them; a longer line is kept cut, saying so
STUCK_S = 1.0  # once children were stopped early, output the caller's stream has not taken for this long is dropped


class Ended:
    """How something watched ended, once it has: `status` (exit code, signal), the failure it reported."""

    status: tuple[int | None, int | None] | None = None  # (exit code, signal) once it ended
    failure: FailureRecord | None = None
    lost = False  # nothing is known of how it ended (never, for a child of this process: its end is always seen)

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


class Child(Ended):
    """A started child: its pid, pipes, the last lines it printed, what it sent back and how it ended."""

    def __init__(
        self, pid: int, popen: subprocess.Popen[bytes] | None, msg_fd: int, out_fd: int, err_fd: int, name: str,
        oom_before: int | None,
    ) -> None:
        self.pid, self.popen, self.name = pid, popen, name
        self.oom_before = oom_before  # the cgroup's OOM-kill count read just before the child started (None: unreadable)
        self.msg_fd, self.out_fd, self.err_fd = msg_fd, out_fd, err_fd
        self.reader = FrameReader()
        self.cutters: dict[int, lines.LineCutter] = {}  # set by the Watcher it is added to, which decides how to cut
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._tail_open: dict[int, bool] = {}  # the tail's last line is an unfinished one from this pipe
        self.status: tuple[int | None, int | None] | None = None  # (exit code, signal) once reaped
        self.ended_at: float | None = None  # time.monotonic() when it was reaped
        self.reported = False  # a "result" or "error" message arrived
        self.result: bytes | None = None
        self.failure: FailureRecord | None = None
        self.waiting_for: list[str] = []  # names of the non-daemon threads it waited for once its target was done
        try:
            self.pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self.pidfd = None

    def note(self, fd: int, text: str) -> None:
        """Keep `text` (a line or a piece of one) in the tail, each line cut to TAIL_LINE_CHARS."""
        text = echo.printable(text)
        finished = text.endswith("\n")
        body = text[:-1] if finished else text
        if self._tail_open.get(fd) and self.tail:
            last = self.tail[-1]
            if len(last) < TAIL_LINE_CHARS:
                self.tail[-1] = cut_line(last + body)
        else:
            self._tail_open.clear()
            self.tail.append(cut_line(body))
        self._tail_open[fd] = not finished

    def poll(self) -> bool:
        """Reap the child if it has exited, SIGKILLing what is left in its process group first (its watchdog,
        grandchildren of a child that died abruptly); True once it has. The group is signalled while the
        unreaped child still holds its pid: once reaped, the number is free, and a process that takes it
        later and leads a group of its own (another program, a Ray worker) must never be signalled."""
        if self.status is not None:
            return True
        try:
            if os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return False
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            _, raw = os.waitpid(self.pid, 0)
        except ChildProcessError:  # reaped by someone else (the caller's own os.wait())
            self.status, self.ended_at = (None, None), time.monotonic()
            return True
        self.ended_at = time.monotonic()
        code = os.waitstatus_to_exitcode(raw)
        if self.popen is not None:
            self.popen.returncode = code  # reaped here: the Popen must not wait for it again
        self.status = (code, None) if code >= 0 else (None, -code)
        return True

    def signal_tree(self, signum: int) -> None:
        """Send `signum` to the child's process group (everything it started), or to the child alone
        while it has not made its group yet."""
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signum)


def cut_line(line: str) -> str:
    """`line` as a failure report keeps it: at most TAIL_LINE_CHARS characters, saying so when cut."""
    if len(line) <= TAIL_LINE_CHARS:
        return line
    return line[: TAIL_LINE_CHARS - 40] + f" [... cut: a line over {TAIL_LINE_CHARS} characters]"


def output_excerpt(lines: list[str]) -> str:
    """The part of a child's last output worth showing: a fatal-error stack dump if there is one, else the last lines."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
    if starts:
        return "\n".join(lines[starts[-1] : starts[-1] + REPORT_LINES])
    return "\n".join(lines[-REPORT_LINES:])


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
def exit_on_terminate(signals: tuple[signal.Signals, ...] = TERMINATING_SIGNALS) -> Iterator[None]:
    """While this block waits for children in the main thread: SIGTERM or SIGHUP, which by default kill this
    process at once (its children then die by SIGKILL with it), raise SystemExit(128 + signal) instead, so the
    waiting code stops its children with their grace period first and a child's own SIGTERM handler can save
    a checkpoint (torchrun's agent does the same). Only the first one counts: a second SIGTERM or SIGHUP (a
    closed terminal sends two, a scheduler may repeat its SIGTERM) comes while the children are being stopped
    and must not cut their grace short; a second Ctrl-C (SIGINT) still does. A handler the caller installed is
    left in place; outside the main thread, where Python runs no signal handler, nothing changes. `signals`: others
    that stop the children the same way (`levers9 run --signals-to-handle`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = ExitOnFirstSignal()
    replaced = {signum: signal.signal(signum, handler) for signum in signals
                if signal.getsignal(signum) is signal.SIG_DFL}  # fmt: skip
    try:
        yield
    finally:
        for signum, previous in replaced.items():
            signal.signal(signum, previous)


class ExitOnFirstSignal:
    """A signal handler that raises SystemExit(128 + signal) the first time, and ignores the signals after it."""

    def __init__(self) -> None:
        self.fired = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if not self.fired:
            self.fired = True
            raise SystemExit(128 + signum)


LineSink = Callable[[Child, str, str], None]  # (child, "stdout" or "stderr", line without its newline)
TextSink = lines.TextSink  # (child, stream, text): a line with its newline, or a piece of a long one without


class Watcher:
    """Children on one selector: their output goes to `on_line` (whole lines) or `on_text` (lines and pieces
    of long ones, so no line is ever held whole), called in order on a thread of the watcher's own; their
    messages go to the Child. An exception from the callback is raised by the next `pump`."""

    def __init__(self, on_line: LineSink | None = None, *, on_text: TextSink | None = None, immediate: bool = False,
                 exact: bool = False) -> None:  # fmt: skip
        if (on_line is None) == (on_text is None):
            raise TypeError("Watcher takes exactly one of on_line and on_text")
        self.children: list[Child] = []
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = fds.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)
        sink: TextSink = on_text if on_text is not None else lines.WholeLines(on_line)  # type: ignore[arg-type]
        self.forwarder = lines.Forwarder(sink, self._wake_w)
        self._paused: dict[int, Child] = {}  # output pipes not read while the forwarder is full
        self._stopped_early = False  # stop() found children still running: output is not waited for
        self._cutting = {"immediate": immediate, "exact": exact}  # how output is cut: see lines.LineCutter
        hold_exit_statuses()  # exit statuses stay readable even where the caller ignores SIGCHLD
        self._holding = True

    def add(self, child: Child) -> Child:
        self.children.append(child)
        child.cutters = {fd: lines.LineCutter(**self._cutting) for fd in (child.out_fd, child.err_fd)}
        for fd in (child.msg_fd, child.out_fd, child.err_fd):
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, child)
        if child.pidfd is not None:
            self.selector.register(child.pidfd, selectors.EVENT_READ, child)
        return child

    def pump(self, wait: float) -> None:
        """Wait up to `wait` s for anything to happen; read whatever is ready; reap children that ended.
        Never blocks longer: output the callback has not taken yet waits in the pipes."""
        self.forwarder.check()
        self._pause_or_resume()
        if any(cutter.holding for child in self.children for cutter in child.cutters.values()):
            wait = min(wait, lines.HOLD_S)
        for key, _ in self.selector.select(wait):
            child: Child | None = key.data
            if child is None:  # the forwarder made room
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
                continue
            if key.fd == child.pidfd:
                self._forget(key.fd)
                child.pidfd = None
                continue
            if key.fd in self._paused:
                continue
            try:
                chunk = os.read(key.fd, 1 << 20)
            except BlockingIOError:
                continue
            except OSError as exc:  # a pseudo-terminal whose child end every process closed reads EIO: its end of file
                if exc.errno != errno.EIO:
                    raise
                chunk = b""
            if not chunk:
                self._forget(key.fd)
                if key.fd != child.msg_fd:
                    self._forward(child, key.fd, child.cutters[key.fd].end())
            elif key.fd == child.msg_fd:
                for kind, value in child.reader.feed(chunk):
                    if kind == "waiting":  # it returned, and waits for its non-daemon threads to end
                        child.waiting_for = list(value)
                        continue
                    child.reported = True
                    child.result, child.failure = (value, None) if kind == "result" else (None, value)
            else:
                self._forward(child, key.fd, child.cutters[key.fd].feed(chunk))
                self._pause_or_resume()
        now = time.monotonic()
        for child in self.children:
            for fd, cutter in child.cutters.items():
                if cutter.holding and fd not in self._paused:
                    self._forward(child, fd, cutter.due(now))
            child.poll()

    def _forward(self, child: Child, fd: int, pieces: list[str]) -> None:
        stream = "stdout" if fd == child.out_fd else "stderr"
        for text in pieces:
            child.note(fd, text)
            self.forwarder.put(child, stream, text)

    def _pause_or_resume(self) -> None:
        """Stop reading output pipes while the forwarder is full; read them again once it has room."""
        if self.forwarder.full:
            for key in list(self.selector.get_map().values()):
                child = key.data
                if child is not None and key.fd in (child.out_fd, child.err_fd):
                    self.selector.unregister(key.fd)
                    self._paused[key.fd] = child
        elif self._paused:
            for fd, child in self._paused.items():
                self.selector.register(fd, selectors.EVENT_READ, child)
            self._paused.clear()

    def _forget(self, fd: int) -> None:
        if self._paused.pop(fd, None) is None:
            self.selector.unregister(fd)
        if fds.is_tracked(fd):
            fds.close(fd)
        else:
            os.close(fd)

    def drain(self, seconds: float = 0.5) -> None:
        """Read what is left in the pipes (output written just before exiting), for at most `seconds`, and
        return once the callback has had all of it. Time the caller's stream takes nothing does not count
        while children ended by themselves (their output waits for it, as a full pipe would); once stop()
        had to stop children, output the stream has not taken for STUCK_S is dropped at close()."""
        end = time.monotonic() + seconds
        while self._open_pipes():
            now = time.monotonic()
            if self._paused and not self._stopped_early:
                end = max(end, now + seconds)
            if now >= end:
                break
            self.pump(0.02)
        self.forwarder.flush(STUCK_S if self._stopped_early else None)
        self.forwarder.check()

    def _open_pipes(self) -> bool:
        return bool(self._paused) or any(
            key.data is not None and key.fd != key.data.pidfd for key in self.selector.get_map().values()
        )

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
        """SIGTERM every live child's process group and its descendants outside it, SIGKILL them after
        `grace` s, and reap the children (`poll` SIGKILLs what is left in each one's group, grandchildren
        that ignored SIGTERM, just before). Descendants outside a child's group are found while it lives
        (see py). No group of a child reaped earlier is signalled: its number may be another's now."""
        live = [c for c in self.children if not c.poll()]
        self._stopped_early = self._stopped_early or bool(live)
        strays = {c.pid: outside_group(c.pid) for c in live}
        try:
            for child in live:
                child.signal_tree(signal.SIGTERM)
                child.signal_tree(signal.SIGCONT)  # a stopped process (SIGSTOP, Ctrl-Z) acts on its SIGTERM only once continued
                signal_all(strays[child.pid], signal.SIGTERM)
            if not self.wait(live, grace):
                for child in live:
                    if not child.poll():
                        strays[child.pid] += outside_group(child.pid)
                        child.signal_tree(signal.SIGKILL)
                self.wait(live, None)
        finally:
            for child in self.children:
                if child.status is None:  # not reaped (an interrupt came): it still holds its pid
                    child.signal_tree(signal.SIGKILL)
            for pidfds in strays.values():
                kill_trees(pidfds)

    def close(self) -> None:
        """Hand the callback what is left (all of it, unless stop() found children running: then only what
        the caller's stream takes without stalling for STUCK_S), and close every pipe; the watcher is
        unusable afterwards."""
        try:
            self.forwarder.close(STUCK_S if self._stopped_early else None)
        finally:
            for key in list(self.selector.get_map().values()):
                if key.fd != self._wake_r:
                    self._forget(key.fd)
            for fd in list(self._paused):
                self._forget(fd)
            self.selector.close()
            fds.close(self._wake_r)
            fds.close(self._wake_w)
            if self._holding:
                self._holding = False
                release_exit_statuses()


# Parent side: exit statuses stay readable while levers9 waits for its children, whatever SIGCHLD was set to.
#
# A process whose SIGCHLD is ignored (SIG_IGN, set by the caller or inherited from whoever started it:
# a daemon, a job scheduler's shell) never gets its children's exit statuses: the kernel reaps them
# at once and waitpid fails with ECHILD, so a rank that succeeded would read as "exited with code
# None". While any Watcher is open, SIGCHLD is set to SIG_DFL (which, for SIGCHLD, also ignores the
# signal, but leaves each exited child for its parent to reap); when the last one closes, SIG_IGN is
# put back. The change is made at the C level (any thread may open a Watcher, and Python lets only the
# main thread call signal.signal), so `signal.getsignal(SIGCHLD)` still says SIG_IGN throughout; a
# handler the caller installed, or the default, is never touched. Children started meanwhile begin
# with SIGCHLD at its default.

_SIG_DFL, _SIG_IGN = 0, 1
_lock = threading.Lock()
_holders = 0
_restore = False  # SIGCHLD was ignored when the first holder came, and is put back when the last goes


def hold_exit_statuses() -> None:
    """One more waiter that needs exit statuses (pair with `release_exit_statuses`)."""
    global _holders, _restore
    with _lock:
        _holders += 1
        if _holders == 1 and signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
            _restore = _set(_SIG_DFL) == _SIG_IGN


def release_exit_statuses() -> None:
    """One waiter less; the last puts back an ignored SIGCHLD."""
    global _holders, _restore
    with _lock:
        _holders -= 1
        if _holders == 0 and _restore:
            _set(_SIG_IGN)
            _restore = False


def _set(disposition: int) -> int | None:
    """Set SIGCHLD's disposition at the C level; the previous one."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    previous: int | None = libc.signal(int(signal.SIGCHLD), disposition)
    return previous or 0


# Waits of the caller's thread that a Ctrl-C always cuts short.
#
# The kernel hands a signal sent to a process to any of its threads that does not block it, not always to
# the main one. Python runs the handler (the KeyboardInterrupt of a Ctrl-C) on the main thread only, and
# only when that thread next runs Python code: a main thread asleep in one long blocking call sleeps through
# a Ctrl-C that one of levers9's own threads (the forker, the output forwarder) happened to receive, until
# the call returns. So every long wait of the caller's thread is cut into WAKE_S steps.


WAKE_S = 0.1  # the longest a Ctrl-C handed to another thread waits before the main thread raises it


def sleep(seconds: float) -> None:
    """`time.sleep(seconds)` in WAKE_S steps: a signal handler's exception (KeyboardInterrupt) is raised
    within WAKE_S of the signal, whichever thread the kernel handed it to."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, WAKE_S))


# Both sides: a child's whole process tree, read from /proc, the parts that left its process group or
# session included.
#
# A levers9 child makes itself a child subreaper (Linux's PR_SET_CHILD_SUBREAPER): a process whose parent
# dies (a daemon's double fork) is re-parented to the child instead of to PID 1, so it stays in the child's
# tree. The child stops its whole tree when its target returns (`end_descendants`), and the parent, stopping
# a child early, finds the child's descendants that left its process group (`outside_group`) while the child
# still lives. What was re-parented to PID 1 because the child itself died first (SIGKILL, a crash,
# os._exit) cannot be found again.


_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Make orphaned descendants of this process its children (Linux; elsewhere nothing happens)."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _table() -> dict[int, tuple[int, int, str]]:
    """Every process's (parent, process group, state letter), read from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(entry)] = (int(fields[1]), int(fields[2]), fields[0].decode())
    return table


def descendants(root: int, table: dict[int, tuple[int, int, str]] | None = None) -> list[int]:
    """Live (not zombie) descendants of `root`, parents before their children."""
    table = _table() if table is None else table
    below: dict[int, list[int]] = {}
    for pid, (ppid, _, state) in table.items():
        if state != "Z":
            below.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for pid in below.get(todo.pop(), []):
            found.append(pid)
            todo.append(pid)
    return found


def outside_group(root: int) -> list[int]:
    """Pidfds of `root`'s live descendants that are not in its process group (a signal to the group misses them)."""
    table = _table()
    return _open([pid for pid in descendants(root, table) if table[pid][1] != root])


def _open(pids: list[int]) -> list[int]:
    handles = []
    for pid in pids:
        with contextlib.suppress(OSError):
            handles.append(os.pidfd_open(pid))
    return handles


def signal_all(pidfds: list[int], signum: int) -> None:
    """Send `signum` to each process (one that has ended is skipped)."""
    for pidfd in pidfds:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pidfd, signum)


def kill_trees(pidfds: list[int]) -> None:
    """SIGKILL each process and every descendant it has, freezing each with SIGSTOP first so none of them
    forks a process that is missed; closes the pidfds."""
    try:
        signal_all(pidfds, signal.SIGSTOP)
        seen = {_pid_of(fd) for fd in pidfds}
        for _ in range(100):
            table = _table()
            new = [p for root in list(seen) for p in descendants(root, table) if p not in seen]
            if not new:
                break
            opened = _open(new)
            signal_all(opened, signal.SIGSTOP)
            pidfds = pidfds + opened
            seen.update(new)
        signal_all(pidfds, signal.SIGKILL)
    finally:
        for fd in pidfds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _pid_of(pidfd: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        with open(f"/proc/self/fdinfo/{pidfd}") as f:
            for line in f:
                if line.startswith("Pid:"):
                    return int(line.split()[1])
    return -1


def end_descendants(seconds: float = 2.0) -> None:
    """In a subreaper: SIGKILL every descendant of this process and reap those that became its children,
    for at most `seconds` (re-parented grandchildren are found on the next round)."""
    me, end = os.getpid(), time.monotonic() + seconds
    while _has_children() and time.monotonic() < end:  # in a subreaper, a descendant implies a child
        table = _table()
        live = descendants(me, table)
        mine = [pid for pid, (ppid, _, _) in table.items() if ppid == me]
        if not live and not mine:
            return
        kill_trees(_open(live))
        for pid in mine:
            _reap(pid, end)


def _has_children() -> bool:
    """True if this process has a child, live or not yet reaped (none of them is reaped here)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _reap(pid: int, end: float) -> None:
    """Wait (until `end` at the latest) for this process's child `pid` to end, and reap it."""
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done or time.monotonic() >= end:
            return
        time.sleep(0.002)
