"""Child side: what runs inside a child that start.py started, forked or as a fresh interpreter.

The child leads its own session and dies with its parent: the kernel's parent-death signal for itself, and a
watchdog process in its group that kills the whole group once the parent's lifeline pipe reads end of file,
so what the target started dies too. It writes its output to the parent's pipes, runs the target, sends back
("result", value) or ("error", FailureRecord), and ends as an interpreter ends (interpreter.py). As a child
subreaper it kills every descendant it still has when the target is done, daemons that left its group or
session included (watch.py), so nothing it started outlives it. Descriptors it was handed (message pipe,
lifeline, lease locks) are never inherited by what it starts (fds.py). The target's value must already be
bytes or None (the caller's target decides what is shipped back).

`python -m levers9.procs.child` is the fresh-interpreter entry: everything arrives on stdin.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import faulthandler
import io
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from levers9.procs import fds, interpreter, watch
from levers9.procs.failure import capture, exit_status, send, unship

_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class Ends:
    """The child's ends of its pipes, and who its parent is."""

    parent_pid: int
    msg_fd: int
    out_fd: int
    err_fd: int
    lifeline_fd: int
    held: tuple[int, ...] = ()  # lease locks the child holds for as long as it lives
    stdin_fd: int | None = None  # the caller's stdin, to become the child's (None: /dev/null)


def forked_main(target: Callable[[], Any], ends: Ends, env: dict[str, str]) -> NoReturn:
    """Entry point right after os.fork(): never returns."""
    status = 70
    try:
        with contextlib.suppress(OSError):
            os.setsid()
        die_with_parent(ends.parent_pid)
        _redirect_stdio(ends.out_fd, ends.err_fd, ends.stdin_fd)
        main = threading.current_thread()  # the forker thread's copy is this process's main thread: named,
        main.name, main._daemonic = "MainThread", False  # type: ignore[attr-defined]  # and its threads non-daemon by default
        interpreter.begin_forked()
        status = run_target(target, ends, env)
    finally:
        os._exit(status)


def fresh_main() -> NoReturn:
    """Entry point of a fresh interpreter: sys.path, cwd, ends, env and the shipped target come on stdin."""
    interpreter.mark_own_objects()
    sys_path, cwd, ends, env, blob = pickle.loads(sys.stdin.buffer.read())
    die_with_parent(ends.parent_pid)
    for fd in (ends.msg_fd, ends.lifeline_fd, *ends.held):
        fds.adopt(fd)  # passed inheritable; what the target starts must not hold them
    sys.path[:] = sys_path
    with contextlib.suppress(OSError):
        os.chdir(cwd)
    _set_stdin(ends.stdin_fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    os._exit(run_target(blob, ends, env))


def run_target(target: Callable[[], Any] | bytes, ends: Ends, env: dict[str, str]) -> int:
    """Run the target (unpickled first if it came shipped, so its modules import under `env`, as a forked
    child's already are) and send its outcome; returns the exit status to leave with. Its signal handlers run
    while it computes, whichever of its threads the kernel gives a signal (interpreter.relay_signals_to_main)."""
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # what a fresh interpreter has; a fork had the caller's
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # kept ignored under nohup, as exec keeps it
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    watch.become_subreaper()
    watchdog: subprocess.Popen[bytes] | int | None = None
    status = 0
    try:
        watchdog = _start_watchdog(ends.lifeline_fd)  # in here: one that cannot start (ulimit -u) is reported as any failure
        interpreter.relay_signals_to_main()  # a thread: the same
        send(ends.msg_fd, ("result", (unship(target) if isinstance(target, bytes) else target)()))
    except SystemExit as exc:
        status = exit_status(exc)
        send(ends.msg_fd, ("result", None) if status == 0 else ("error", capture(exc, exitcode=status)))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        status = 1
        send(ends.msg_fd, ("error", capture(exc)))
        interpreter.uncaught(exc)
    finally:
        interpreter.shutdown(lambda names: send(ends.msg_fd, ("waiting", names)))
        flush_std_streams()
        if watchdog is not None:
            _stop_watchdog(watchdog)
        watch.end_descendants()
    return status


def flush_std_streams() -> None:
    """Flush sys.stdout and sys.stderr, whatever they have been replaced by."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def die_with_parent(expected_parent: int) -> None:
    """Ask the kernel to SIGKILL this process when the parent's forking thread exits (Linux); exit now
    if the parent is already gone."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != expected_parent:
        os._exit(1)


# The watchdog's program: /bin/sh reads its stdin (the lifeline) until end of file, then SIGKILLs its
# process group. It ignores the terminal's SIGINT and SIGHUP, which reach the whole group, so a hang-up
# of the caller's terminal cannot end it before the lifeline says the caller is gone.
_WATCHDOG_SCRIPT = "trap '' INT HUP; read _; kill -KILL 0"


def _start_watchdog(lifeline_fd: int) -> subprocess.Popen[bytes] | int:
    """Start a tiny process in this child's group that kills the whole group once the lifeline reads end
    of file (the parent died); its handle for `_stop_watchdog`. A process, not a thread: it works while
    the target holds the GIL, and it outlives a child that is killed, so what the child started dies too.
    It is /bin/sh, started without copying this process (vfork and exec, every other descriptor closed:
    forking a process with torch loaded costs about 5 ms each way); a fork of this one where there is no shell."""
    try:
        watchdog: subprocess.Popen[bytes] | int = subprocess.Popen(
            ["levers9-watchdog", "-c", _WATCHDOG_SCRIPT],
            executable="/bin/sh",
            stdin=lifeline_fd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except OSError:
        watchdog = fds.fork_child((lifeline_fd,), lambda: _watch_lifeline(lifeline_fd))
    fds.close(lifeline_fd)
    return watchdog


def _watch_lifeline(lifeline_fd: int) -> None:
    """The forked watchdog's body: `_WATCHDOG_SCRIPT` in Python."""
    try:
        os.closerange(0, lifeline_fd)
        os.closerange(lifeline_fd + 1, 4096)
        for signum in (signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with contextlib.suppress(OSError):  # nothing is ever written: the read returns at end of file
            while os.read(lifeline_fd, 1):  # (a signal does not end it: Python retries reads on EINTR)
                pass
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(0)


def _stop_watchdog(watchdog: subprocess.Popen[bytes] | int) -> None:
    """Kill and reap the watchdog of a child that is ending by itself: an orphaned watchdog would end
    as a zombie of PID 1, and a container's PID 1 is often a program that never reaps its orphans."""
    with contextlib.suppress(OSError):
        if isinstance(watchdog, int):
            os.kill(watchdog, signal.SIGKILL)
            os.waitpid(watchdog, 0)
        else:
            watchdog.kill()
            watchdog.wait()


def _set_stdin(stdin_fd: int | None) -> None:
    """Make descriptor 0 the caller's stdin (`stdin_fd`), or /dev/null when None, with a fresh sys.stdin on it
    (the caller's may hold input it read ahead, or be a test runner's stand-in)."""
    source = os.open(os.devnull, os.O_RDONLY) if stdin_fd is None else stdin_fd
    if source != 0:
        os.dup2(source, 0)
        os.close(source)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), line_buffering=True)


def _redirect_stdio(out_fd: int, err_fd: int, stdin_fd: int | None) -> None:
    """Point fds 1 and 2 at the parent's pipes (or pseudo-terminals), 0 at the caller's stdin or /dev/null,
    and give Python fresh line-buffered streams on them."""
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in {out_fd, err_fd} - {1, 2}:
        fds.close(fd)
    _set_stdin(stdin_fd)
    sys.stdout, sys.stderr = _line_stream(1), _line_stream(2)


def _line_stream(fd: int) -> io.TextIOWrapper:
    """A line-buffered UTF-8 text stream on `fd` that never fails on what it is given to write."""
    return io.TextIOWrapper(
        io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True, write_through=True
    )


if __name__ == "__main__":
    fresh_main()
