"""The local executor: each cell is a process of its own on cards leased from this machine.

The cells run in input order on as many lanes (threads, see backend.py) as the batch could ever run at
once: eligible cards // cards per job, or the CPU count for CPU jobs. A lane waits in the lease queue for
its cell's cards, starts the job process (levers9.procs: a fork of the caller when that is safe, a fresh
interpreter otherwise), supervises it and resolves the cell's Future (the retry loop: outcomes.py). The
job process holds its card locks itself, so its cards come free when it dies, whoever kills it.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from typing import Any

from levers9.launch import job_process, outcomes
from levers9.launch.backend import Batch, dispatch
from levers9.launch.cells import Cell
from levers9.launch.local.leases import Lease, LeaseDir
from levers9.launch.outcomes import Cancelled
from levers9.launch.pool import Pool, local_pool
from levers9.launch.settings import lease_dirs, load_settings
from levers9.launch.spec import check_feasible
from levers9.procs import start
from levers9.procs.supervise import Supervisor
from levers9.procs.watch import Watcher
from levers9.runtime import JobContext

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
            primary, fallback = lease_dirs()
            names = [c.lock_name for c in pool.cards]
            leases = LeaseDir(primary / pool.pool_id, names, fallback and fallback / pool.pool_id)
            lanes = max(1, len(_eligible(groups)) // spec.gpu_count)
        else:
            lanes = max(1, os.cpu_count() or 1)
        method = start.choose()
        if not method.forks:
            log.debug("starting jobs as fresh interpreters: %s", method.reason)
        cells = [_LocalCell(batch, cell, Future(), pool, leases, groups, method) for cell in batch.cells]
        dispatch(batch, cells, lanes)
        return [c.future for c in cells]


def _eligible(groups: list[list[int]]) -> list[int]:
    return sorted({s for g in groups for s in g})


class _LocalCell:
    """Runs one cell to completion on this machine: queue for its cards, start, supervise, retry, resolve the Future."""

    def __init__(
        self,
        batch: Batch,
        cell: Cell,
        future: Future[Any],
        pool: Pool | None,
        leases: LeaseDir | None,
        groups: list[list[int]],
        method: start.StartMethod,
    ) -> None:
        self.batch, self.cell, self.future = batch, cell, future
        self.pool, self.leases, self.groups = pool, leases, groups
        self.method = method
        self.label = batch.cell_label(cell)

    def stopped(self) -> bool:
        return self.batch.cancel.cancelled or self.future.cancelled()

    def take_place(self) -> None:
        """Nothing yet: a local cell queues for its cards (a lease ticket) when an attempt starts. Lanes never
        outnumber the jobs the eligible cards hold at once, so each taken cell gets cards as soon as no other
        caller holds them (while another caller holds some, the lanes' cells are served in ticket order)."""

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
                raise outcomes.queue_timed_out(
                    self.label, spec.queue_timeout, f"{spec.describe_cards()} at once",
                    f"{free} of this machine's {len(self.pool.cards)} cards are free now ({self.pool.describe()})",
                ) from None  # fmt: skip
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
        with outcomes.JobAttempt.begin(self.batch, self.label, cell, attempt) as run:  # its logs close at the end
            cards = (
                [self.pool.cards[s] for s in lease.slots] if lease is not None and self.pool is not None else []
            )
            env = job_process.job_env(spec, [c.nvml_index for c in cards])
            context = JobContext(
                run_id=self.batch.run_id,
                cell_index=cell.index,
                attempt=attempt,
                job_dir=str(run.job_dir),
                gpu_count=len(cards),
                gpu_type=cards[0].type_name if cards else "",
                simulated=bool(cards and self.pool and self.pool.simulated),
                stall_timeout=spec.stall_timeout,
                max_restarts=spec.max_restarts,
            )
            target = job_process.JobTarget(self.batch.func, cell.args, cell.kwargs, context)
            shipped = None if self.method.forks else job_process.ship_target(target)
            watcher = Watcher(lambda child, stream, line: run.output(stream, line + "\n"))
            try:
                child = watcher.add(start.start(target, method=self.method, shipped=shipped, env=env,
                                                keep=tuple(lease.fds) if lease is not None else (), name=self.label))  # fmt: skip
            finally:
                if lease is not None:
                    lease.release()  # the job process holds the locks now
            try:
                self.batch.events.started(cell, env["CUDA_VISIBLE_DEVICES"] if cards else "no card", attempt)
                started = time.time()
                supervisor = Supervisor(watcher, [child], timeout=spec.timeout, grace=spec.stop_grace,
                                        should_stop=self.stopped)  # fmt: skip
                outcome = supervisor.run(every=0.1)[0]
            finally:
                watcher.stop(spec.stop_grace)
                watcher.close()
            meta = {"cards": env.get("CUDA_VISIBLE_DEVICES", ""), "started": started, "ended": time.time()}
            return outcomes.finish(run, outcome, spec.timeout, meta)
