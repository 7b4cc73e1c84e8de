"""Parent side: every descriptor levers9 opens for its children, so a forked child closes those not its own.

A flock is released only when every copy of its descriptor is closed, and a pipe reports end of file only when
every copy of its write end is closed. A child forked while other children are being started would inherit
their lease locks, tickets and pipes, and hold them for its own lifetime. Everything opened here is tracked
under one lock, and every fork of this process happens under that lock, so the child's snapshot is exact. A
child forked by anyone but `fork_child` (the caller's multiprocessing helper, a job's own daemon) gets none of
them: they are closed in it right after the fork, so such a process never holds a card's lease, a lifeline or
a pipe of levers9's.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterable

_FORK_WARNING = r"This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead to deadlocks in the child"
_lock = threading.Lock()
# Process-wide, as descriptors are: those this layer opened, closed by any fork that is not their owner.
_tracked: set[int] = set()
_keep_next: tuple[int, frozenset[int]] | None = None  # (thread, descriptors) of the fork `fork_child` makes


def adopt(fd: int) -> int:
    """Track a descriptor this process was handed (made close-on-exec), as if it had been opened here."""
    with _lock:
        os.set_inheritable(fd, False)
        _tracked.add(fd)
        return fd


def open_fd(path: str, flags: int, mode: int = 0o644) -> int:
    """os.open, tracked (and close-on-exec)."""
    with _lock:
        fd = os.open(path, flags | os.O_CLOEXEC, mode)
        _tracked.add(fd)
        return fd


def pipe() -> tuple[int, int]:
    """os.pipe, both ends tracked (and close-on-exec)."""
    with _lock:
        read_end, write_end = os.pipe()
        _tracked.update((read_end, write_end))
        return read_end, write_end


def openpty(size_of: int | None = None) -> tuple[int, int]:
    """A pseudo-terminal (main end, child's end), both tracked and close-on-exec. Output passes through the
    child's end unchanged (no "\\n" made "\\r\\n"); it gets the window size of the terminal `size_of`, if given."""
    import fcntl
    import termios

    with _lock:
        main, child = os.openpty()  # both non-inheritable (PEP 446)
        _tracked.update((main, child))
    attrs = termios.tcgetattr(child)
    attrs[1] &= ~termios.OPOST  # output flags: no post-processing
    termios.tcsetattr(child, termios.TCSANOW, attrs)
    if size_of is not None:
        with contextlib.suppress(OSError):
            fcntl.ioctl(child, termios.TIOCSWINSZ, fcntl.ioctl(size_of, termios.TIOCGWINSZ, b"\0" * 8))
    return main, child


def is_tracked(fd: int) -> bool:
    """True if `fd` was opened here and is not closed yet."""
    with _lock:
        return fd in _tracked


def close(fd: int) -> None:
    """Close a tracked descriptor (a no-op if it is already closed)."""
    with _lock:
        if fd in _tracked:
            _tracked.discard(fd)
            os.close(fd)


def fork_child(keep: Iterable[int], child: Callable[[], None]) -> int:
    """Fork; in the child close every tracked descriptor not in `keep`, then run `child` (which must not return).
    Python 3.12+'s DeprecationWarning on a fork of a process with threads, and only it, is not shown for this
    fork: levers9 forks from its own forker thread on purpose, after making the fork safe (start.py)."""
    global _keep_next
    with _lock:
        _keep_next = (threading.get_ident(), frozenset(keep))
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", _FORK_WARNING, DeprecationWarning)
                pid = os.fork()
        finally:
            _keep_next = None
    if pid == 0:
        try:
            child()
        finally:
            os._exit(70)
    return pid


def _before_fork() -> None:
    if _keep_next is None or _keep_next[0] != threading.get_ident():
        _lock.acquire()  # no other thread is opening or closing one while the child's copy is made


def _after_fork_in_parent() -> None:
    if _keep_next is None or _keep_next[0] != threading.get_ident():
        _lock.release()


def _after_fork_in_child() -> None:
    """Close every tracked descriptor the child was not asked to keep; a fresh lock (the parent's was held)."""
    global _lock
    keep = _keep_next[1] if _keep_next is not None and _keep_next[0] == threading.get_ident() else frozenset()
    for fd in _tracked - keep:
        with contextlib.suppress(OSError):
            os.close(fd)
    _tracked.intersection_update(keep)
    _lock = threading.Lock()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
