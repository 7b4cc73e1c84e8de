"""Parent side: start a child process, the fastest way that is safe.

Fork where that is safe, start a fresh interpreter where it is not. Forking is safe on Linux while CUDA is
untouched in this process (a child forked after the CUDA driver was initialised cannot use CUDA). Forks happen
on one long-lived forker thread that never runs user work, never on the caller's: a child is a copy of the
thread that forked it, so it inherits no OpenMP team of the caller's (GNU OpenMP keeps a thread's team in that
thread's own storage; a child forked from a thread that ran a parallel region hangs in its first one), and the
kernel's parent-death signal follows the thread that forked, so that thread lives as long as this process. The
fork happens while the forker holds every logging handler's lock, so no thread of the caller's that logs is
caught holding its stream's lock; the child writes to new streams on its own pipes.
`LEVERS9_START_METHOD=spawn` forces fresh interpreters; `=fork` insists on forking.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import pickle
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

from levers9.errors import ConfigError
from levers9.procs import child, fds, oom
from levers9.procs.watch import Child

START_VAR = "LEVERS9_START_METHOD"
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class StartMethod:
    """'fork' or 'spawn' (a fresh interpreter), and why children cannot be forked when they are not."""

    method: str
    reason: str = ""

    @property
    def forks(self) -> bool:
        return self.method == "fork"


@dataclasses.dataclass(frozen=True)
class Stdio:
    """A child's standard streams: a pseudo-terminal for stdout or stderr where the caller's is a terminal
    (its descriptor here, for the window size; None: a pipe), and the caller's stdin or /dev/null."""

    out_terminal: int | None = None
    err_terminal: int | None = None
    stdin: bool = False

    @classmethod
    def like_caller(cls, *, stdin: bool) -> Stdio:
        """What a process the caller started itself would have: a terminal where sys.stdout / sys.stderr are
        one, and (`stdin`) the caller's stdin where it has one open."""
        return cls(_terminal_of(sys.stdout), _terminal_of(sys.stderr), stdin and _is_open(0))


def _terminal_of(stream: Any) -> int | None:
    """The descriptor of `stream` when it is a terminal; None otherwise (None, closed, or unable to say)."""
    with contextlib.suppress(Exception):
        if stream.isatty():
            return int(stream.fileno())
    return None


def _is_open(fd: int) -> bool:
    with contextlib.suppress(OSError):
        os.fstat(fd)
        return True
    return False


def fork_is_safe() -> tuple[bool, str]:
    """(True, "") if children forked now can use CUDA, else (False, the reason)."""
    if sys.platform != "linux":
        return False, f"fork is only used on Linux (this is {sys.platform})"
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return False, "CUDA is already initialised in this process"
    if _cuda_driver_loaded():
        return False, "the CUDA driver (libcuda) is already loaded in this process"
    return True, ""


def _cuda_driver_loaded() -> bool:
    """True if libcuda.so is mapped into this process (someone called into the CUDA driver)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any("libcuda.so" in line for line in maps)
    except OSError:
        return False


def choose(requested: str | None = None) -> StartMethod:
    """The start method: `requested` ('fork', 'spawn' or None), else $LEVERS9_START_METHOD, else fork where safe."""
    source = "start_method=" if requested else f"{START_VAR}="
    requested = requested or os.environ.get(START_VAR) or "auto"
    if requested not in ("auto", "fork", "spawn"):
        raise ConfigError(
            f"{source}{requested!r}; expected 'fork', 'spawn' or unset (fork where safe, else a fresh interpreter)."
        )
    safe, reason = fork_is_safe()
    if requested == "fork" and not safe:
        raise ConfigError(f"{source}'fork' is not safe here: {reason}. Pass 'spawn', or leave it unset.")
    if requested == "spawn":
        return _check_cwd(StartMethod("spawn", f"{source}'spawn' was asked for"))
    return StartMethod("fork") if safe else _check_cwd(StartMethod("spawn", reason))


def _check_cwd(method: StartMethod) -> StartMethod:
    """`method` (a fresh interpreter), once this process's current folder exists: the child starts in it and
    imports from it, as the caller does; ConfigError naming the folder when it was deleted."""
    try:
        os.getcwd()
    except FileNotFoundError:
        try:
            gone = os.readlink("/proc/self/cwd")
        except OSError:
            gone = "the current folder"
        raise ConfigError(
            f"the current folder {gone!r} no longer exists, and a fresh interpreter ({method.reason}) starts in "
            f"its caller's current folder. Expected an existing folder; os.chdir() to one (or cd in the shell) "
            f"before starting, or use start_method='fork'."
        ) from None
    return method


_lock = threading.Lock()  # guards the two per-process singletons below
_forker: tuple[threading.Thread, queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]]] | None = None
_lifeline: tuple[int, int] | None = None  # read end for children; the write end stays open until this process dies


def _on_forker(fn: Callable[[], T]) -> T:
    """fn() run on the forker thread, one long-lived daemon thread that does every fork and exec of this
    process (started on first use); its value, or its exception raised here."""
    global _forker
    with _lock:
        if _forker is None:
            requests: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
            _forker = (threading.Thread(target=_serve, args=(requests,), name="levers9-forker", daemon=True), requests)
            _forker[0].start()
        thread, requests = _forker
    if threading.current_thread() is thread:
        return fn()
    future: Future[T] = Future()
    requests.put((fn, future))
    return future.result()


def _serve(requests: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]]) -> None:
    while True:
        fn, future = requests.get()
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            future.set_exception(exc)


def _lifeline_read_end() -> int:
    global _lifeline
    with _lock:
        if _lifeline is None:
            _lifeline = fds.pipe()
        return _lifeline[0]


def _after_fork_in_child() -> None:
    """The forker thread and the lifeline are the parent's: a child makes its own on first use (fds.py has
    closed the lifeline's ends in it, so a helper the caller forks never keeps the caller's children alive)."""
    global _lock, _forker, _lifeline
    _lock, _forker, _lifeline = threading.Lock(), None, None


os.register_at_fork(after_in_child=_after_fork_in_child)


def start(
    target: Callable[[], Any],
    *,
    method: StartMethod,
    shipped: bytes | None = None,
    env: dict[str, str] | None = None,
    keep: tuple[int, ...] = (),
    name: str = "",
    stdio: Stdio = Stdio(),
) -> Child:
    """Start a child that runs `target()` and sends back its outcome (see child.py).

    Forked: `target` is used as it is (nothing is pickled). Fresh interpreter: `shipped` must be
    `failure.ship(target)`; the caller ships it so that it can say what could not be pickled. The
    child leads its own session, gets `env` on top of this process's environment, and keeps the descriptors in
    `keep` (lock files it must hold) besides its own pipes; `stdio` says what its standard streams are."""
    env = dict(env or {})
    oom_before = oom.oom_kills()  # before the child runs: one the OOM killer takes at once still raises the count
    msg_r, msg_w = fds.pipe()
    out_r, out_w = fds.pipe() if stdio.out_terminal is None else fds.openpty(stdio.out_terminal)
    err_r, err_w = fds.pipe() if stdio.err_terminal is None else fds.openpty(stdio.err_terminal)
    lifeline = _lifeline_read_end()
    stdin_fd = None
    if stdio.stdin:  # a forked child keeps descriptor 0; a fresh one is handed a copy (its 0 carries the payload)
        stdin_fd = 0 if method.forks else fds.adopt(os.dup(0))
    ends = child.Ends(os.getpid(), msg_w, out_w, err_w, lifeline, keep, stdin_fd)
    try:
        if method.forks:
            child.flush_std_streams()
            keep_fds = (msg_w, out_w, err_w, lifeline, *keep)  # (descriptor 0 is never tracked: always kept)
            pid = _on_forker(lambda: _fork(keep_fds, lambda: child.forked_main(target, ends, env)))
            handle = Child(pid, None, msg_r, out_r, err_r, name, oom_before)
        else:
            if shipped is None:
                raise ValueError("start(method=spawn) needs shipped=failure.ship(target)")
            popen = _on_forker(lambda: _exec(ends, env, keep))
            handle = Child(popen.pid, popen, msg_r, out_r, err_r, name, oom_before)
            assert popen.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                pickle.dump((list(sys.path), os.getcwd(), ends, env, shipped), popen.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                popen.stdin.close()
    except BaseException:
        for fd in (msg_r, out_r, err_r):
            fds.close(fd)
        raise
    finally:
        for fd in (msg_w, out_w, err_w, *([] if not stdin_fd else [stdin_fd])):
            fds.close(fd)
    return handle


def _fork(keep: tuple[int, ...], child_main: Callable[[], None]) -> int:
    """Fork while holding every logging handler's lock, so the child inherits no stream lock held by a thread it
    does not have (logging itself re-creates its own locks in the child)."""
    import logging

    handlers = [ref() for ref in list(getattr(logging, "_handlerList", []))]
    held = [h for h in handlers if isinstance(h, logging.Handler) and h.lock is not None]
    for handler in held:
        handler.acquire()
    try:
        return fds.fork_child(keep, child_main)
    finally:
        for handler in held:
            handler.release()


def _exec(ends: child.Ends, env: dict[str, str], keep: tuple[int, ...]) -> subprocess.Popen[bytes]:
    """A fresh interpreter running child.py, with this interpreter's own flags (-O, -I, -W, -X ...), as
    multiprocessing's spawn passes them: an assert the caller stripped with -O is stripped in the child too."""
    flags: list[str] = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
    return subprocess.Popen(
        [sys.executable, *flags, "-m", "levers9.procs.child"],
        stdin=subprocess.PIPE,
        stdout=ends.out_fd,
        stderr=ends.err_fd,
        pass_fds=(ends.msg_fd, ends.lifeline_fd, *keep, *([] if ends.stdin_fd is None else [ends.stdin_fd])),
        env={**os.environ, **env},
        start_new_session=True,
    )


# Parent side: while this process only plans, starts and watches ranks, the objects it had before are held
# out of its garbage collector, as CPython advises for a process that forks (`gc.freeze`'s documentation).
# `import torch` leaves a full collection due (about 175,000 objects, 60 to 80 ms here) that the next few
# thousand new objects set off: held, starting the ranks does not pay it, and no collection writes into
# those objects' headers, which would copy every page the ranks still share with this process. After, they
# are handed back and that collection falls due again. A caller's own freeze is left as it is; but CPython
# 3.12 keeps its immortal static types' tuples frozen (375 in a bare interpreter, frozen again at every full
# collection), and a freeze of no more than that is the interpreter's, not the caller's.


@functools.cache
def _interpreters_own_freeze() -> int:
    """How many objects this Python keeps frozen of its own: 0, but on CPython 3.12 (read once, from a bare
    interpreter of the same executable)."""
    if sys.version_info[:2] != (3, 12):
        return 0
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        bare = subprocess.run([sys.executable, "-I", "-S", "-c", "import gc; print(gc.get_freeze_count())"],
                              capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
        return int(bare.stdout)
    return 0


@contextlib.contextmanager
def held_heap() -> Iterator[None]:
    """Within: the objects this process has now are out of its collector's reach (not freed by it, not
    traversed). After, even on an exception: every one of them is back, unless the caller held some itself."""
    if gc.get_freeze_count() > _interpreters_own_freeze():  # the caller's own freeze: leave it, and hand back nothing
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
