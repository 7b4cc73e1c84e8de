"""Parent side: every descriptor levers9 opens for its children, so a forked child closes those not its own.

A flock is released only when every copy of its descriptor is closed, and a pipe reports end of
file only when every copy of its write end is closed. A child forked while other children are being
started would inherit their lease locks, tickets and pipes, and hold them for its own lifetime.
Everything opened here is tracked under one lock, and `fork_child` forks under that lock so the
child's snapshot is exact.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable

_lock = threading.Lock()
_tracked: set[int] = set()


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
    """Fork; in the child close every tracked descriptor not in `keep`, then run `child` (which must not return)."""
    keep = set(keep)
    with _lock:
        pid = os.fork()
        if pid == 0:
            for fd in _tracked - keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
            _tracked.clear()
            _tracked.update(keep)
    if pid == 0:
        try:
            child()
        finally:
            os._exit(70)
    return pid
