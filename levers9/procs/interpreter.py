"""Child side: a forked child begins as a fresh interpreter would, and every child ends as an interpreter ends.

A fork copies the caller's whole state; a fresh interpreter (what torchrun and mp.spawn start) has its own.
So right after the fork the child gets what a new process would have: unseeded random generators of its own
(torch's and numpy's; CPython reseeds `random` itself after a fork), no exit handlers of the caller's (they
would act on the caller's resources from every child; one a module registers on import, such as logging's, is
registered again, as a new interpreter importing it would), and signal handlers that run while it computes
(`relay_signals_to_main`). Code that seeds after that keeps its seeds exactly.

At the end, `shutdown` does what Py_FinalizeEx does before the process exits, in its order: `threading`'s exit
hooks run (a ThreadPoolExecutor's tell its workers to stop), the non-daemon threads are joined (their names
sent to the parent first, so a run stopped while it waits for them can say which), `atexit` handlers run, and
files the child opened and left open are flushed. `uncaught` calls a `sys.excepthook` the code installed for
an exception nothing caught (not the default hook, nor torch's that only prefixes it with the rank: the parent
reports that traceback).
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import ctypes
import gc
import io
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable

from levers9.procs.failure import user_frames


def begin_forked() -> None:
    """Right after the fork: the child's own random state and exit handlers, as a fresh interpreter has."""
    mark_own_objects()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()  # a nondeterministic seed for the CPU generator (and, lazily, the cards'), as at import
    numpy_random = sys.modules.get("numpy.random")  # not imported yet: the child's import seeds it afresh
    if numpy_random is not None:
        numpy_random.seed()  # the legacy global generator, from the OS's entropy as at import
    atexit._clear()
    logging = sys.modules.get("logging")
    if logging is not None:
        atexit.register(logging.shutdown)  # what `import logging` registers in a fresh interpreter


_wakeup_pipe: tuple[int, ...] = ()  # this process's relay pipe, once it has one


def relay_signals_to_main() -> None:
    """Make this process's Python signal handlers run while its main thread computes, whichever of its threads got
    the signal. levers9 calls it in every process it runs your code in (a rank, a job process, a SLURM task).

    The kernel hands a signal sent to a process to any thread that does not block it: torch's own (there from
    `import torch`), gloo's, NCCL's. Up to CPython 3.12 the C handler, run on such a thread, notes the signal but
    does not ask the main thread to run the Python handler (bpo-40010): a main thread computing Python code without
    releasing the GIL runs it only at the next signal the kernel gives it, or never (SLURM's early signal comes
    right behind a SIGCONT, which the main thread may still hold pending on a busy node). From 3.13 on the C handler
    asks the interpreter's first thread state, which after a fork from another thread (levers9 forks from its
    forker thread, start.py) belongs to no living thread: the handlers would run only when a system call returns
    EINTR. Here the C handler also writes the signal's number to a pipe (`signal.set_wakeup_fd`); a thread of
    levers9's reads it and queues a call of `PyErr_CheckSignals` for the main thread (`Py_AddPendingCall`, CPython's
    public C API), which that thread makes the next time it takes the GIL, as the reader's wake asks it to: within
    the switch interval (5 ms) while it computes. The thread is started with `_thread`, so `threading.enumerate()`
    lists only the threads a fresh interpreter has, and it is never joined. Code that sets its own wakeup
    descriptor (asyncio's `add_signal_handler` does) replaces this one (docs/limitations.md). Call it from the
    main thread (`set_wakeup_fd` is refused elsewhere)."""
    global _wakeup_pipe
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return  # free-threaded builds: not supported (docs/limitations.md)
    for end in _wakeup_pipe:  # a parent's (a job's rank): its relay thread is not in this process
        with contextlib.suppress(OSError):
            os.close(end)
    _wakeup_pipe = read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # the C handler must never block on a full pipe
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    # Our own function objects: ctypes.pythonapi's attributes are shared with the code in this process
    add_pending_call = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(("Py_AddPendingCall", ctypes.pythonapi))
    check_signals = ctypes.cast(ctypes.pythonapi.PyErr_CheckSignals, ctypes.c_void_p)

    def relay() -> None:
        with contextlib.suppress(OSError):
            while os.read(read_end, 512):  # one byte per signal the C handler saw
                add_pending_call(check_signals, None)  # -1 when 32 are queued already: one is enough

    _thread.start_new_thread(relay, ())


def mark_own_objects() -> None:
    """Mark where the child's own objects begin: everything older is frozen out of `gc.get_objects()`,
    so `shutdown` flushes only files the child opened (the caller's buffered files must not be written twice)."""
    gc.freeze()


def uncaught(exc: BaseException) -> None:
    """Call the code's own `sys.excepthook` for `exc`, as the interpreter does for an uncaught exception."""
    hook = sys.excepthook
    if _beneath_torchs_prefixes(hook) is sys.__excepthook__ or isinstance(exc, SystemExit):
        return
    try:
        exc = exc.with_traceback(user_frames(exc.__traceback__))  # from the code's first frame, as for a script
        hook(type(exc), exc, exc.__traceback__)
    except BaseException:  # noqa: BLE001 - as the interpreter does: a failing hook is reported, not raised
        print("Error in sys.excepthook:", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)


def _beneath_torchs_prefixes(hook: Callable[..., object]) -> Callable[..., object]:
    """The hook beneath the ones torch's init_process_group installs (each only puts "[rankN]: " before the lines of
    the hook it found): the default one is not called for them either, or the traceback the parent reports would
    be printed twice."""
    while getattr(hook, "__module__", None) == "torch.distributed.distributed_c10d" and hook.__closure__:
        cells = dict(zip(hook.__code__.co_freevars, hook.__closure__, strict=True))
        if "old_hook" not in cells:
            break
        hook = cells["old_hook"].cell_contents
    return hook


def shutdown(say_waiting: Callable[[list[str]], None]) -> None:
    """End as Py_FinalizeEx does (see above); `say_waiting` gets the waited-for threads' names first. Never raises."""
    waiting = [t for t in threading.enumerate() if not t.daemon and t is not threading.current_thread() and t.is_alive()]
    if waiting:
        with contextlib.suppress(Exception):
            say_waiting([t.name for t in waiting])
    with contextlib.suppress(BaseException):  # threading's exit hooks first (a ThreadPoolExecutor is told to stop
        threading._shutdown()  # type: ignore[attr-defined]  # its workers), then every non-daemon thread joined
    for thread in waiting:  # where that failed
        thread.join()
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()  # prints and ignores a failing handler, as at a normal exit
    _flush_open_files()


def _flush_open_files() -> None:
    """Flush every writable file object the child created and did not close (a fresh interpreter's
    finalisation closes them, which flushes them)."""
    with contextlib.suppress(Exception):
        for obj in gc.get_objects():
            if isinstance(obj, io.IOBase) and obj not in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    if not obj.closed and obj.writable():
                        obj.flush()
