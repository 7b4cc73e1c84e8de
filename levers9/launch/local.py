"""The local executor: each cell is a process of its own on cards leased from this machine.

A dispatcher runs a batch's cells in input order on as many lanes (threads) as the batch could ever
run at once, so threads and open descriptors grow with the machine's cards, never with the number of
cells. A lane waits in the lease queue for its cell's cards, starts the job process (a fork of the
caller when that is safe, which costs milliseconds; a fresh interpreter otherwise), streams its
output to the caller and to a log folder, enforces the timeout on the job's whole process group,
retries as the spec says and resolves the cell's Future. The job process holds its card locks
itself, so its cards come free when it dies, whoever kills it. It leaves with the caller: a
watchdog in its process group reads a lifeline pipe whose end of file means the caller died, and
PR_SET_PDEATHSIG backs it up. How job processes are started and killed is in process.py; the retry
loop, the run folders and what a finished attempt becomes are in outcomes.py, shared with Ray.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from levers9.errors import JobTimeout
from levers9.launch import fds, outcomes, runner, runs
from levers9.launch.backend import Batch
from levers9.launch.cells import Cell
from levers9.launch.leases import Lease, LeaseDir
from levers9.launch.outcomes import Cancelled, OutputTail
from levers9.launch.policy import check_feasible
from levers9.launch.pool import Pool, local_pool
from levers9.launch.process import ship_function, start_job, start_method
from levers9.launch.settings import lease_dir, load_settings

log = logging.getLogger("levers9.launch")


class LocalBackend:
    """Runs batches on this machine's cards (or simulated ones)."""

    def submit(self, batch: Batch) -> list[Future[Any]]:
        """Check feasibility, then hand the cells to a dispatcher; one Future per cell, in order."""
        spec = batch.spec
        pool: Pool | None = None
        leases: LeaseDir | None = None
        groups: list[list[int]] = []
        if spec.gpu_count > 0:
            pool = local_pool(simulate=load_settings().simulate_gpus)
            groups = check_feasible(spec, pool)
            leases = LeaseDir(lease_dir() / pool.pool_id, [c.lock_name for c in pool.cards])
            lanes = max(1, len(_eligible(groups)) // spec.gpu_count)
        else:
            lanes = max(1, os.cpu_count() or 1)
        use_fork, why = start_method()
        shipped = None if use_fork else ship_function(batch.func)
        if not use_fork:
            log.debug("starting jobs as fresh interpreters: %s", why)
        run_dir = runs.run_folder(batch.run_id)
        supervisors = [
            _Supervisor(batch, cell, Future(), pool, leases, groups, use_fork, shipped, run_dir)
            for cell in batch.cells
        ]
        _Dispatcher(batch, supervisors, min(lanes, len(supervisors))).start()
        return [sup.future for sup in supervisors]


def _eligible(groups: list[list[int]]) -> list[int]:
    return sorted({s for g in groups for s in g})


class _Dispatcher:
    """Runs a batch's cells in input order on a fixed number of lanes (threads).

    A lane takes the next cell, waits for its cards (holding one lease ticket while it waits), runs
    it to its end, then takes the next. With as many lanes as the batch could ever run at once
    (eligible cards // cards per job, or the CPU count for CPU jobs), threads and open descriptors
    depend on the machine, not on the number of cells; a cell queued behind the lanes holds nothing.
    """

    def __init__(self, batch: Batch, supervisors: list[_Supervisor], lanes: int) -> None:
        self.batch = batch
        self.queue: collections.deque[_Supervisor] = collections.deque(supervisors)
        self.lanes = lanes
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the lanes; on cancel, queued cells are cancelled at once instead of one by one."""
        self.batch.cancel.on_cancel(self._cancel_queued)
        name = self.batch.label or self.batch.spec.name
        for lane in range(self.lanes):
            threading.Thread(target=self._lane, name=f"levers9-{name}-lane{lane}", daemon=True).start()

    def _next(self) -> _Supervisor | None:
        with self._lock:
            return self.queue.popleft() if self.queue else None

    def _lane(self) -> None:
        while (sup := self._next()) is not None:
            sup.run()

    def _cancel_queued(self) -> None:
        with self._lock:
            queued = list(self.queue)
        for sup in queued:
            sup.future.cancel()


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
        use_fork: bool,
        shipped: tuple[tuple[str, str] | None, bytes | None] | None,
        run_dir: Path,
    ) -> None:
        self.batch, self.cell, self.future = batch, cell, future
        self.pool, self.leases, self.groups = pool, leases, groups
        self.use_fork, self.shipped, self.run_dir = use_fork, shipped, run_dir
        self.label = batch.cell_label(cell)

    def stopped(self) -> bool:
        return self.batch.cancel.cancelled or self.future.cancelled()

    def run(self) -> None:
        """Attempt the cell until it succeeds, fails for good or is cancelled; always resolves the Future."""
        outcomes.attempt_cell(self.batch, self.cell, self.future, self._attempt, log)

    def _attempt(self, attempt: int) -> Any:
        spec = self.batch.spec
        lease: Lease | None = None
        if self.stopped():
            raise Cancelled()
        if self.leases is not None and self.pool is not None:
            ticket = self.leases.take_ticket(_eligible(self.groups))
            try:
                lease = self.leases.acquire(
                    ticket,
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
            if lease is None:
                raise Cancelled()
        try:
            if attempt == 1 and not self.future.set_running_or_notify_cancel():
                raise Cancelled()
            return self._run_process(attempt, lease)
        finally:
            if lease is not None:
                lease.release()

    def _run_process(self, attempt: int, lease: Lease | None) -> Any:
        spec, cell = self.batch.spec, self.cell
        run = outcomes.JobAttempt.begin(self.run_dir, self.label, cell.index, attempt, spec)
        job_dir = run.job_dir
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
        lock_fds = list(lease.fds) if lease is not None else []
        try:
            proc, out_r, err_r = start_job(
                self.use_fork, self.batch.func, self.shipped, cell, env, job_dir, lock_fds
            )
        finally:
            if lease is not None:
                lease.release()  # the job process holds the locks now
        tail = OutputTail()
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
        proc.kill_group()
        for reader in readers:
            reader.join(timeout=5.0)
        run.write_meta(
            {
                "pid": proc.pid,
                "cards": env.get("CUDA_VISIBLE_DEVICES", ""),
                "attempt": attempt,
                "started": started,
                "ended": time.time(),
                "exit_code": exitcode,
                "signal": signum,
                "killed_for": killed_for,
            }
        )
        if killed_for == "cancel":
            raise Cancelled()
        if killed_for == "timeout":
            raise outcomes.timed_out(run, spec.timeout, proc.pid)
        return outcomes.result(run, proc.pid, exitcode, signum, tail)

    def _pump(self, fd: int, stream: str, log_path: Path, tail: OutputTail) -> None:
        """Copy a job's output to its log file, the tail and the caller, line by line."""
        try:
            with open(fd, "rb", closefd=False) as pipe, open(log_path, "ab") as log_file:
                for raw in pipe:
                    log_file.write(raw)
                    log_file.flush()
                    line = raw.decode("utf-8", errors="replace")
                    tail.add(line)
                    if self.batch.spec.stream_output:
                        self.batch.events.output(self.cell, stream, line.rstrip("\n"))
        finally:
            fds.close(fd)
