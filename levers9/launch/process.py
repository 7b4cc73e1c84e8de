"""Job processes: start one (a fork of the caller, or a fresh interpreter), wait on it with a
timeout, kill its whole process group, and read how it ended.

A forked job costs milliseconds (no interpreter start, no second `import torch`) and is used
whenever forking is safe (CUDA untouched in the caller). The child closes every descriptor the job
layer opened for other jobs, moves its stdout/stderr onto pipes back to the caller, and leaves with
os._exit. The fresh-interpreter path ships the function by reference when it is importable and by
value (cloudpickle) when it is defined in __main__ or a notebook. Either way the job is the leader
of a new session, so one killpg reaches everything it started.
"""

from __future__ import annotations

import abc
import contextlib
import io
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import cloudpickle

from levers9.distributed.forking import die_with_parent, fork_is_safe
from levers9.errors import NotShippableError
from levers9.launch import fds, runner
from levers9.launch.backend import CancelToken
from levers9.launch.cells import Cell

START_VAR = "LEVERS9_JOB_START"  # "exec" forces a fresh interpreter per job even where fork is safe
_lifeline_lock = threading.Lock()
_lifeline: tuple[int, int] | None = None


def lifeline_read_end() -> int:
    """The read end of this process's lifeline pipe; the write end stays open until this process dies."""
    global _lifeline
    with _lifeline_lock:
        if _lifeline is None:
            _lifeline = fds.pipe()
        return _lifeline[0]


def _forget_lifeline() -> None:
    global _lifeline
    _lifeline = None


os.register_at_fork(after_in_child=_forget_lifeline)


def start_method() -> tuple[bool, str]:
    """(True, reason) when this process may fork its jobs; (False, why not) when each job must be a
    fresh interpreter: CUDA is in use here, or LEVERS9_JOB_START=exec asks for it."""
    use_fork, why = fork_is_safe()
    if os.environ.get(START_VAR) == "exec":
        use_fork, why = False, f"{START_VAR}=exec"
    return use_fork, why


def start_job(
    use_fork: bool, func: Callable[..., Any], shipped: tuple[tuple[str, str] | None, bytes | None] | None,
    cell: Cell, env: dict[str, str], job_dir: Path, lock_fds: list[int],
) -> tuple[JobProcess, int, int]:  # fmt: skip
    """Start the cell's job process (a fork, or a fresh interpreter running `shipped`) tied to this
    process's lifeline; returns it and the read ends of its stdout and stderr pipes."""
    out_r, out_w = fds.pipe()
    err_r, err_w = fds.pipe()
    lifeline = lifeline_read_end()
    proc: JobProcess
    try:
        if use_fork:
            proc = ForkedJob.start(func, cell, env, job_dir, out_w, err_w, lifeline, lock_fds)
        else:
            proc = ExecJob.start(cell, shipped, env, job_dir, out_w, err_w, lifeline, lock_fds)
    except BaseException:
        fds.close(out_r)
        fds.close(err_r)
        raise
    finally:
        fds.close(out_w)
        fds.close(err_w)
    return proc, out_r, err_r


def ship_function(func: Callable[..., Any]) -> tuple[tuple[str, str] | None, bytes | None]:
    """(module, qualname) when a fresh interpreter can import `func`, else its cloudpickle by value."""
    module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", "")
    if module and module != "__main__" and "<locals>" not in qualname:
        try:
            from levers9.launch.worker import resolve

            if resolve(module, qualname) is func:
                return (module, qualname), None
        except Exception:
            pass
    try:
        return None, cloudpickle.dumps(func)
    except Exception as exc:
        raise NotShippableError(
            f"{qualname or func!r} cannot be sent to a fresh interpreter ({type(exc).__name__}: {exc}), which is "
            f"how jobs start when this process has already initialised CUDA. Define it at module level, "
            f"or start the jobs before touching CUDA in this process."
        ) from exc


class JobProcess(abc.ABC):
    """A started job process: wait on it with a timeout, kill its group, read how it ended."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._status: tuple[int | None, int | None] | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None

    @abc.abstractmethod
    def _reap(self, block: bool) -> bool:
        """Collect the exit status if the process has ended (waiting for it if `block`); True once it has."""

    def _wait(self, timeout: float | None) -> bool:
        """True once the process has ended (reaped), False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._reap(block=False):
            left = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
            if left <= 0:
                return False
            if self._pidfd is not None:
                select.select([self._pidfd], [], [], left)
            else:
                time.sleep(min(left, 0.01))
        return True

    def watch(
        self, timeout: float | None, grace: float, cancel: CancelToken, future: Future[Any]
    ) -> str | None:
        """Wait for the end; kill the group on timeout or cancel. Returns None, 'timeout' or 'cancel'."""
        deadline = None if timeout is None else time.monotonic() + timeout
        reason: str | None = None
        kill = threading.Event()
        unregister = cancel.on_cancel(kill.set)
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                step = 0.1 if left is None else max(0.0, min(0.1, left))
                if self._wait(step):
                    return reason
                if kill.is_set() or future.cancelled():
                    reason = "cancel"
                elif deadline is not None and time.monotonic() >= deadline:
                    reason = "timeout"
                else:
                    continue
                self._kill(grace)
                return reason
        finally:
            unregister()
            if self._pidfd is not None:
                _close_quietly(self._pidfd)
                self._pidfd = None

    def _kill(self, grace: float) -> None:
        """SIGTERM the job's process group, SIGKILL it after `grace` seconds, and reap the job."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGTERM)
        if not self._wait(grace):
            self.kill_group()
            self._wait(None)

    def kill_group(self) -> None:
        """SIGKILL whatever is left in the job's process group (what the job started and left behind)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def status(self) -> tuple[int | None, int | None]:
        """(exit code, None) or (None, signal number) of the ended process."""
        assert self._status is not None
        return self._status

    @staticmethod
    def _decode(status: int) -> tuple[int | None, int | None]:
        if os.WIFSIGNALED(status):
            return None, os.WTERMSIG(status)
        return os.WEXITSTATUS(status), None


def _line_stream(fd: int) -> io.TextIOWrapper:
    """A line-buffered UTF-8 text stream on `fd` that never fails on what it is given to write."""
    return io.TextIOWrapper(
        io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


class ForkedJob(JobProcess):
    """A job forked from the caller: no interpreter start, no second `import torch`."""

    @classmethod
    def start(
        cls, func: Callable[..., Any], cell: Cell, env: dict[str, str], job_dir: Path,
        out_w: int, err_w: int, lifeline: int, lock_fds: list[int],
    ) -> ForkedJob:  # fmt: skip
        parent = os.getpid()

        def child() -> None:
            os.setsid()
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.close(out_w)
            os.close(err_w)
            sys.stdout = _line_stream(1)
            sys.stderr = _line_stream(2)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            die_with_parent(parent)
            code = 70
            try:
                code = runner.run_cell(
                    func,
                    cell.args,
                    cell.kwargs,
                    env=env,
                    result_path=job_dir / runner.RESULT_FILE,
                    lifeline_fd=lifeline,
                )
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)

        pid = fds.fork_job([out_w, err_w, lifeline, *lock_fds], child)
        return cls(pid)

    def _reap(self, block: bool) -> bool:
        if self._status is not None:
            return True
        try:
            pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            self._status = (None, None)
            return True
        if pid == 0:
            return False
        self._status = self._decode(status)
        return True


class ExecJob(JobProcess):
    """A job started as a fresh interpreter (`python -m levers9.launch.worker`)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        super().__init__(popen.pid)

    @classmethod
    def start(
        cls, cell: Cell, shipped: tuple[tuple[str, str] | None, bytes | None] | None,
        env: dict[str, str], job_dir: Path, out_w: int, err_w: int, lifeline: int, lock_fds: list[int],
    ) -> ExecJob:  # fmt: skip
        assert shipped is not None
        func_ref, func_blob = shipped
        payload = {
            "parent_pid": os.getpid(),
            "sys_path": [p for p in sys.path if p],
            "func_ref": func_ref,
            "func": func_blob,
            "arguments": cloudpickle.dumps((cell.args, dict(cell.kwargs))),
            "env": env,
            "result_path": str(job_dir / runner.RESULT_FILE),
            "lifeline_fd": lifeline,
        }
        input_path = job_dir / "input.pkl"
        input_path.write_bytes(cloudpickle.dumps(payload))
        popen = subprocess.Popen(
            [sys.executable, "-m", "levers9.launch.worker", str(input_path)],
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=out_w,
            stderr=err_w,
            pass_fds=[lifeline, *lock_fds],
            start_new_session=True,
        )
        return cls(popen)

    def _reap(self, block: bool) -> bool:
        if self._status is not None:
            return True
        code = self.popen.wait() if block else self.popen.poll()
        if code is None:
            return False
        self._status = (None, -code) if code < 0 else (code, None)
        return True
