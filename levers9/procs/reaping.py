"""Parent side: exit statuses stay readable while levers9 waits for its children, whatever SIGCHLD was set to.

A process whose SIGCHLD is ignored (SIG_IGN, set by the caller or inherited from whoever started it:
a daemon, a job scheduler's shell) never gets its children's exit statuses: the kernel reaps them
at once and waitpid fails with ECHILD, so a rank that succeeded would read as "exited with code
None". While any Watcher is open, SIGCHLD is set to SIG_DFL (which, for SIGCHLD, also ignores the
signal, but leaves each exited child for its parent to reap); when the last one closes, SIG_IGN is
put back. The change is made at the C level (any thread may open a Watcher, and Python lets only the
main thread call signal.signal), so `signal.getsignal(SIGCHLD)` still says SIG_IGN throughout; a
handler the caller installed, or the default, is never touched. Children started meanwhile begin
with SIGCHLD at its default.
"""

from __future__ import annotations

import ctypes
import signal
import threading

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
