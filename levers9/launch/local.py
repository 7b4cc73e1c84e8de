"""The local executor: each cell is a process of its own on cards leased from this machine.

One supervisor thread per cell waits in the lease queue, starts the job process (a fork of the
caller when that is safe, which costs milliseconds; a fresh interpreter otherwise), streams its
output to the caller and to a log folder, enforces the timeout on the job's whole process group,
retries as the spec says and resolves the cell's Future. The job process holds its card locks
itself, so its cards come free when it dies, whoever kills it. It leaves with the caller: a
watchdog in its process group reads a lifeline pipe whose end of file means the caller died, and
PR_SET_PDEATHSIG backs it up. How job processes are started and killed is in process.py.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import shutil
import signal
import threading
import time
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Any

from levers9.distributed.forking import fork_is_safe
from levers9.errors import JobCrashed, JobTimeout, RankFailure, signal_name
from levers9.launch import fds, runner
from levers9.launch.backend import Batch
from levers9.launch.cells import Cell
from levers9.launch.leases import Lease, LeaseDir
from levers9.launch.policy import check_feasible
from levers9.launch.pool import Pool, local_pool
from levers9.launch.process import ExecJob, ForkedJob, JobProcess, lifeline_read_end, ship_function
from levers9.launch.settings import lease_dir, load_settings, runs_dir

log = logging.getLogger("levers9.launch")

START_VAR = "LEVERS9_JOB_START"  # "exec" forces a fresh interpreter per job even where fork is safe
KEEP_RUNS = 50  # run folders kept under runs_dir(); older ones are removed when a new run starts
TAIL_LINES = 40


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
        shipped = None if use_fork else ship_function(batch.func)
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
        lifeline = lifeline_read_end()
        lock_fds = list(lease.fds) if lease is not None else []
        proc: JobProcess
        try:
            if self.use_fork:
                proc = ForkedJob.start(self.batch.func, cell, env, job_dir, out_w, err_w, lifeline, lock_fds)
            else:
                proc = ExecJob.start(cell, self.shipped, env, job_dir, out_w, err_w, lifeline, lock_fds)
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
