"""`timeout=` for code that runs in this process: a rank under a launcher, or a world of one in place.

No parent of levers9's watches such a process, so it watches itself. When the time is up, RunTimeout
is raised in the thread that called `run` (at its next Python instruction; a SIGALRM first
interrupts a blocking system call when that thread is the main thread). A rank under a launcher whose
thread is stuck inside native code (a collective that never returns) prints its stack and exits
with code 124 a few seconds later, so the launcher stops the other ranks; a process running in place
is the user's own and is never killed.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import threading
from types import FrameType, TracebackType

from levers9.errors import RunTimeout

EXIT_AFTER_S = 5.0  # a rank under a launcher that has not unwound this long after its timeout exits
TIMEOUT_EXIT_CODE = 124  # as timeout(1)


class SelfTimer:
    """Context manager: RunTimeout in the calling thread once `seconds` have passed (no-op for None)."""

    def __init__(self, seconds: float | None, what: str, *, under_launcher: bool) -> None:
        self.seconds, self.what, self.under_launcher = seconds, what, under_launcher
        self._done = threading.Event()
        self._thread_id = threading.get_ident()
        self._old_handler: object = None

    def __enter__(self) -> SelfTimer:
        if self.seconds is None:
            return self
        if threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGALRM, self._on_alarm)
        threading.Thread(target=self._watch, name="levers9-self-timer", daemon=True).start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._done.set()
        if self._old_handler is not None:
            signal.signal(signal.SIGALRM, self._old_handler)  # type: ignore[arg-type]
        if et is RunTimeout and not str(ev):  # raised bare by PyThreadState_SetAsyncExc
            raise self.error() from None

    def error(self) -> RunTimeout:
        return RunTimeout(
            f"{self.what} timed out: still running after {self.seconds:g} s (timeout={self.seconds:g}). Expected "
            f"fn to finish within the timeout; pass a larger timeout=, or None for no limit."
        )

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        if not self._done.is_set():
            raise self.error()

    def _watch(self) -> None:
        assert self.seconds is not None
        if self._done.wait(self.seconds):
            return
        if self._old_handler is not None:
            signal.pthread_kill(self._thread_id, signal.SIGALRM)
        else:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id), ctypes.py_object(RunTimeout))
        if not self.under_launcher or self._done.wait(EXIT_AFTER_S):
            return
        print(f"levers9: {self.error()} It did not unwind within {EXIT_AFTER_S:g} s; its stacks:", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(TIMEOUT_EXIT_CODE)
