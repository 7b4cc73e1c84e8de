"""Child side: a forked child begins as a fresh interpreter would, and every child ends as an interpreter ends.

A fork copies the caller's whole state; a fresh interpreter (what torchrun and mp.spawn start) has its
own. So right after the fork the child gets what a new process would have: unseeded random generators
of its own (torch's and numpy's; CPython reseeds `random` itself after a fork), and no exit handlers
of the caller's (they would act on the caller's resources from every child; a handler a module
registers when it is imported, such as logging's, is registered again, as a new interpreter
importing that module would). Code that seeds after that keeps its seeds exactly.

At the end, `shutdown` does what Py_FinalizeEx does before the process exits, in its order:
`threading`'s exit hooks run (a ThreadPoolExecutor's tell its workers to stop) and the non-daemon
threads are joined (their names sent to the parent first, so a run stopped while it waits for them
can say which), then `atexit` handlers run, and files the child opened and left open are flushed. `uncaught` calls a `sys.excepthook` the code installed for an
exception nothing caught (the default hook is not called, nor torch's that only prefixes it with the rank:
the parent reports that traceback).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
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
    """End as Py_FinalizeEx does: run `threading`'s exit hooks and join non-daemon threads (`say_waiting` gets
    their names first), run `atexit` handlers, flush files the child left open. Never raises."""
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
