"""Waits of the caller's thread that a Ctrl-C always cuts short.

The kernel hands a signal sent to a process to any of its threads that does not block it, not always
to the main one. Python runs the handler (the KeyboardInterrupt of a Ctrl-C) on the main thread only,
and only when that thread next runs Python code: a main thread asleep in one long blocking call sleeps
through a Ctrl-C that one of levers9's own threads (the forker, the output forwarder) happened to
receive, until the call returns. So every long wait of the caller's thread is cut into WAKE_S steps.
"""

from __future__ import annotations

import time

WAKE_S = 0.1  # the longest a Ctrl-C handed to another thread waits before the main thread raises it


def sleep(seconds: float) -> None:
    """`time.sleep(seconds)` in WAKE_S steps: a signal handler's exception (KeyboardInterrupt) is raised
    within WAKE_S of the signal, whichever thread the kernel handed it to."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, WAKE_S))
