"""The local executor: each cell is a process of its own on cards leased from this machine.

One supervisor thread per cell waits in the lease queue, starts the job process (a fork of the
caller when that is safe, which costs milliseconds; a fresh interpreter otherwise), streams its
output to the caller and to a log folder, enforces the timeout on the job's whole process group,
retries as the spec says and resolves the cell's Future. The job process holds its card locks
itself, so its cards come free when it dies, whoever kills it. It leaves with the caller: a
lifeline pipe (end of file means the caller died) and PR_SET_PDEATHSIG.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Any

import cloudpickle

from levers9.distributed.forking import die_with_parent, fork_is_safe
from levers9.errors import JobCrashed, JobTimeout, NotShippableError, RankFailure, signal_name
from levers9.launch import fds, runner
from levers9.launch.backend import Batch
from levers9.launch.cells import Cell
from levers9.launch.leases import Lease, LeaseDir
from levers9.launch.policy import check_feasible
from levers9.launch.pool import Pool, local_pool
from levers9.launch.settings import lease_dir, load_settings, runs_dir

log = logging.getLogger("levers9.launch")

START_VAR = "LEVERS9_JOB_START"  # "exec" forces a fresh interpreter per job even where fork is safe
KEEP_RUNS = 50  # run folders kept under runs_dir(); older ones are removed when a new run starts
TAIL_LINES = 40

_lifeline_lock = threading.Lock()
_lifeline: tuple[int, int] | None = None


def _lifeline_read_end() -> int:
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


class _Cancelled(Exception):
    """The batch was cancelled while this cell waited or ran."""


class LocalBackend:
    """Runs batches on this machine's cards (or simulated ones)."""

    def submit(self, batch: Batch) -> list[Future[Any]]:
        """Check feasibility, then start one supervisor thread per cell; one Future per cell."""
        spec = batch.spec
        pool: Pool | None = None
        leases: LeaseDir | None = None
        groups: list[list[int]] = []
        if spec.gpu_count > 0:
            pool = local_pool(simulate=load_settings().simulate_gpus)
            groups = check_feasible(spec, pool)
            leases = LeaseDir(lease_dir() / pool.pool_id, [c.lock_name for c in pool.cards])
        use_fork, why = fork_is_safe()
        if os.environ.get(START_VAR) == "exec":
            use_fork, why = False, f"{START_VAR}=exec"
        shipped = None if use_fork else _ship_function(batch.func)
        if not use_fork:
            log.debug("starting jobs as fresh interpreters: %s", why)
        run_dir = _new_run_dir(batch.run_id)
        cpu_slots = threading.BoundedSemaphore(max(1, os.cpu_count() or 1)) if spec.gpu_count == 0 else None
        futures: list[Future[Any]] = []
        supervisors = []
        for cell in batch.cells:
            future: Future[Any] = Future()
            ticket = leases.take_ticket(_eligible(groups)) if leases is not None else None
            sup = _Supervisor(
                batch, cell, future, pool, leases, groups, ticket, cpu_slots, use_fork, shipped, run_dir
            )
            futures.append(future)
            supervisors.append(sup)
        for sup in supervisors:
            threading.Thread(
                target=sup.run, name=f"levers9-{batch.cell_label(sup.cell)}", daemon=True
            ).start()
        return futures


def _eligible(groups: list[list[int]]) -> list[int]:
    return sorted({s for g in groups for s in g})


def _ship_function(func: Callable[..., Any]) -> tuple[tuple[str, str] | None, bytes | None]:
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


def _new_run_dir(run_id: str) -> Path:
    root = runs_dir()
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        old = sorted(root.iterdir(), key=lambda p: p.stat().st_mtime)
        for stale in old[: max(0, len(old) - KEEP_RUNS + 1)]:
            shutil.rmtree(stale, ignore_errors=True)
    path = root / run_id
    path.mkdir(parents=True, exist_ok=True)
    return path


class _Supervisor:
    """Runs one cell to completion: queue, start, watch, retry, resolve the Future."""

    def __init__(
        self,
        batch: Batch,
        cell: Cell,
        future: Future[Any],
        pool: Pool | None,
        leases: LeaseDir | None,
        groups: list[list[int]],
        ticket: Any,
        cpu_slots: threading.BoundedSemaphore | None,
        use_fork: bool,
        shipped: tuple[tuple[str, str] | None, bytes | None] | None,
        run_dir: Path,
    ) -> None:
        self.batch, self.cell, self.future = batch, cell, future
        self.pool, self.leases, self.groups, self.ticket = pool, leases, groups, ticket
        self.cpu_slots, self.use_fork, self.shipped, self.run_dir = cpu_slots, use_fork, shipped, run_dir
        self.label = batch.cell_label(cell)

    def stopped(self) -> bool:
        return self.batch.cancel.cancelled or self.future.cancelled()

    def run(self) -> None:
        """Attempt the cell until it succeeds, fails for good or is cancelled; always resolves the Future."""
        retries = self.batch.spec.retries
        attempt = 1
        try:
            while True:
                try:
                    value = self._attempt(attempt)
                except _Cancelled:
                    if not self.future.cancel():
                        self.future.set_exception(CancelledError(f"{self.label} was cancelled"))
                    return
                except BaseException as exc:
                    kind = _failure_kind(exc)
                    if kind in retries.on and attempt <= retries.max_retries and not self.stopped():
                        log.info(
                            "%s: %s; retrying (attempt %d of %d)",
                            self.label,
                            kind,
                            attempt + 1,
                            retries.max_retries + 1,
                        )
                        attempt += 1
                        if self.batch.cancel.wait(retries.delay(attempt)):
                            continue  # the next attempt notices the cancel
                        if self.leases is not None:
                            self.ticket = self.leases.take_ticket(_eligible(self.groups))
                        continue
                    self.batch.events.finished(self.cell, False)
                    self._settle(exc)
                    return
                self.batch.events.finished(self.cell, True)
                self.future.set_result(value)
                return
        except BaseException as exc:  # a bug in the supervisor itself must still resolve the Future
            if not self.future.done():
                self._settle(exc)
        finally:
            if self.ticket is not None and self.leases is not None:
                self.leases.drop_ticket(self.ticket)

    def _settle(self, exc: BaseException) -> None:
        """Fail the Future with `exc` (unless the caller cancelled it while it was still queued)."""
        if not self.future.running() and not self.future.set_running_or_notify_cancel():
            return
        self.future.set_exception(exc)

    def _attempt(self, attempt: int) -> Any:
        spec = self.batch.spec
        lease: Lease | None = None
        slot_taken = False
        if self.stopped():
            raise _Cancelled()
        if self.leases is not None and self.pool is not None:
            try:
                lease = self.leases.acquire(
                    self.ticket,
                    spec.gpu_count,
                    self.groups,
                    should_stop=self.stopped,
                    excluded=self.pool.foreign_busy,
                    timeout=spec.queue_timeout,
                )
            except TimeoutError:
                free = len(self.leases.free_slots())
                raise JobTimeout(
                    f"{self.label} waited {spec.queue_timeout:g} s (queue_timeout) for {spec.describe_cards()} "
                    f"at once; {free} of this machine's {len(self.pool.cards)} cards are free now "
                    f"({self.pool.describe()}). Raise queue_timeout=, or leave it None to wait."
                ) from None
            self.ticket = None
            if lease is None:
                raise _Cancelled()
        elif self.cpu_slots is not None:
            while not self.cpu_slots.acquire(timeout=0.1):
                if self.stopped():
                    raise _Cancelled()
            slot_taken = True
        try:
            if attempt == 1 and not self.future.set_running_or_notify_cancel():
                raise _Cancelled()
            return self._run_process(attempt, lease)
        finally:
            if lease is not None:
                lease.release()
            if slot_taken and self.cpu_slots is not None:
                self.cpu_slots.release()

    def _run_process(self, attempt: int, lease: Lease | None) -> Any:
        spec, cell = self.batch.spec, self.cell
        job_dir = self.run_dir / f"{cell.index:04d}-{attempt}"
        job_dir.mkdir(parents=True, exist_ok=True)
        cards = (
            [self.pool.cards[s] for s in lease.slots] if lease is not None and self.pool is not None else []
        )
        env = runner.job_env(
            spec,
            nvml_indices=[c.nvml_index for c in cards],
            gpu_type=cards[0].type_name if cards else "",
            simulated=bool(self.pool and self.pool.simulated),
            run_id=self.batch.run_id,
            cell_index=cell.index,
            attempt=attempt,
            job_dir=job_dir,
        )
        out_r, out_w = fds.pipe()
        err_r, err_w = fds.pipe()
        lifeline = _lifeline_read_end()
        lock_fds = list(lease.fds) if lease is not None else []
        proc: _JobProcess
        try:
            if self.use_fork:
                proc = _ForkedJob.start(self.batch.func, cell, env, job_dir, out_w, err_w, lifeline, lock_fds)
            else:
                proc = _ExecJob.start(
                    self.batch, cell, self.shipped, env, job_dir, out_w, err_w, lifeline, lock_fds
                )
        finally:
            fds.close(out_w)
            fds.close(err_w)
            if lease is not None:
                lease.release()  # the job process holds the locks now
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        readers = [
            threading.Thread(
                target=self._pump, args=(out_r, "stdout", job_dir / "stdout.log", tail), daemon=True
            ),
            threading.Thread(
                target=self._pump, args=(err_r, "stderr", job_dir / "stderr.log", tail), daemon=True
            ),
        ]
        for reader in readers:
            reader.start()
        card_text = ",".join(env["CUDA_VISIBLE_DEVICES"].split(",")) if cards else "no card"
        self.batch.events.started(cell, card_text, attempt)
        started = time.time()
        killed_for = proc.watch(spec.timeout, spec.kill_grace, self.batch.cancel, self.future)
        exitcode, signum = proc.status()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the job left behind in its group
        for reader in readers:
            reader.join(timeout=5.0)
        _write_meta(job_dir, proc.pid, env, attempt, started, exitcode, signum, killed_for)
        where = f"Logs: {job_dir}"
        attempts = f"attempt {attempt} of {spec.retries.max_retries + 1}"
        if killed_for == "cancel":
            raise _Cancelled()
        if killed_for == "timeout":
            raise JobTimeout(
                f"{self.label} exceeded timeout={spec.timeout:g}s ({attempts}); its process group {proc.pid} "
                f"was killed and its cards freed. Raise timeout= if it needs longer. {where}"
            )
        outcome = runner.read_outcome(job_dir, self.label)
        if outcome is None:
            how = (
                f"was killed by {signal_name(signum)}"
                if signum is not None
                else f"exited with code {exitcode}"
            )
            hint = (
                " (SIGKILL with no one asking is usually the out-of-memory killer)"
                if signum == signal.SIGKILL
                else ""
            )
            last = "".join(tail).rstrip() or "(no output)"
            failure = RankFailure(
                rank=cell.index, pid=proc.pid, exitcode=exitcode, signal=signum, output_tail="".join(tail)
            )
            raise JobCrashed(
                f"{self.label} (pid {proc.pid}) {how} before returning{hint}; {attempts}. "
                f"Last output:\n{last}\n{where}",
                failure,
            )
        ok, value = outcome
        if ok:
            return value
        runner.add_note(value, f"levers9: {self.label} ran as pid {proc.pid} ({attempts}). {where}")
        raise value

    def _pump(self, fd: int, stream: str, log_path: Path, tail: collections.deque[str]) -> None:
        """Copy a job's output to its log file, the tail and the caller, line by line."""
        try:
            with open(fd, "rb", closefd=False) as pipe, open(log_path, "ab") as log_file:
                for raw in pipe:
                    log_file.write(raw)
                    log_file.flush()
                    line = raw.decode("utf-8", errors="replace")
                    tail.append(line if line.endswith("\n") else line + "\n")
                    if self.batch.spec.stream_output:
                        self.batch.events.output(self.cell, stream, line.rstrip("\n"))
        finally:
            fds.close(fd)


def _failure_kind(exc: BaseException) -> str:
    if isinstance(exc, JobTimeout):
        return "timeout" if "exceeded timeout" in str(exc) else "queue"
    if isinstance(exc, JobCrashed):
        return "crash"
    return "exception"


def _write_meta(
    job_dir: Path, pid: int, env: dict[str, str], attempt: int, started: float,
    exitcode: int | None, signum: int | None, killed_for: str | None,
) -> None:  # fmt: skip
    meta = {
        "pid": pid,
        "cards": env.get("CUDA_VISIBLE_DEVICES", ""),
        "attempt": attempt,
        "started": started,
        "ended": time.time(),
        "exit_code": exitcode,
        "signal": signum,
        "killed_for": killed_for,
    }
    with contextlib.suppress(OSError):
        (job_dir / "meta.json").write_text(json.dumps(meta, indent=1))


class _JobProcess:
    """A started job process: wait on it with a timeout, kill its group, read how it ended."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._status: tuple[int | None, int | None] | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None

    def _reap(self, block: bool) -> bool:
        raise NotImplementedError

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

    def watch(self, timeout: float | None, grace: float, cancel: Any, future: Future[Any]) -> str | None:
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
                fds_close_plain(self._pidfd)
                self._pidfd = None

    def _kill(self, grace: float) -> None:
        """SIGTERM the job's process group, SIGKILL it after `grace` seconds, and reap the job."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGTERM)
        if not self._wait(grace):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            self._wait(None)

    def status(self) -> tuple[int | None, int | None]:
        """(exit code, None) or (None, signal number) of the ended process."""
        assert self._status is not None
        return self._status

    @staticmethod
    def _decode(status: int) -> tuple[int | None, int | None]:
        if os.WIFSIGNALED(status):
            return None, os.WTERMSIG(status)
        return os.WEXITSTATUS(status), None


def fds_close_plain(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


class _ForkedJob(_JobProcess):
    """A job forked from the caller: no interpreter start, no second `import torch`."""

    @classmethod
    def start(
        cls, func: Callable[..., Any], cell: Cell, env: dict[str, str], job_dir: Path,
        out_w: int, err_w: int, lifeline: int, lock_fds: list[int],
    ) -> _ForkedJob:  # fmt: skip
        parent = os.getpid()

        def child() -> None:
            os.setsid()
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.close(out_w)
            os.close(err_w)
            sys.stdout = io.TextIOWrapper(
                io.FileIO(1, "w", closefd=False),
                encoding="utf-8",
                errors="backslashreplace",
                line_buffering=True,
            )
            sys.stderr = io.TextIOWrapper(
                io.FileIO(2, "w", closefd=False),
                encoding="utf-8",
                errors="backslashreplace",
                line_buffering=True,
            )
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


class _ExecJob(_JobProcess):
    """A job started as a fresh interpreter (`python -m levers9.launch.worker`)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        super().__init__(popen.pid)

    @classmethod
    def start(
        cls, batch: Batch, cell: Cell, shipped: tuple[tuple[str, str] | None, bytes | None] | None,
        env: dict[str, str], job_dir: Path, out_w: int, err_w: int, lifeline: int, lock_fds: list[int],
    ) -> _ExecJob:  # fmt: skip
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
