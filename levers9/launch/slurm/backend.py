"""The SLURM backend: the same @job cells as SLURM jobs, submitted with submitit from a login node.

    @job(gpu_count=1, backend="slurm", slurm={"partition": "gpu"})   # or LEVERS9_BACKEND=slurm
    train.map(configs)        # ONE job array, at most `max_running` cells at once (#SBATCH --array=0-N%M)
    big.remote(cfg)           # @job(gpu_count=8) on 4-card nodes: 2 nodes x 4 ranks, one srun task each

submitit (the field's choice) writes the pickles and the sbatch script, submits single jobs and job
arrays, and runs each task through `python -m submitit.core._submit` under srun. It reads job states
with sacct, which needs SLURM's accounting database; this backend reads squeue instead (every cluster
has it), and follows each job by itself (follow.py): its state and node, its output files
(streamed to the caller as they grow, with the local backend's prefixes), and the result file of each
task (job_process.TaskEnded, as a Ray task's). A gpu_count no node holds is one training across the fewest nodes with
equal shares (`--nodes`, `--ntasks-per-node=share`, `--gres=gpu:share`): srun starts every rank (no levers9
agent runs there) and the function runs in each through distributed.run; a restart (max_restarts=) is the job
submitted again, its ranks' TORCHELASTIC_RESTART_COUNT one higher.

`timeout=` is the job's SLURM time limit (rounded up to whole minutes, plus one) and is enforced here to
the second from the moment the job runs (then a stop and JobTimeout). A stop (Ctrl-C, SIGTERM, leaving a
map, timeout=) is SIGTERM to the job's tasks and the kill after stop_grace, done by reaper.py, which
also stops the jobs of a caller that died without stopping them.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import submitit

import levers9.launch.slurm as slurm_options
from levers9 import state_files
from levers9.errors import (
    FailureKind,
    JobConfigError,
    NotShippableError,
)
from levers9.launch import job_process, outcomes
from levers9.launch.backend import Batch, dispatch
from levers9.launch.cells import Cell, cell_key, function_key
from levers9.launch.job_process import TaskPayload
from levers9.launch.outcomes import Cancelled
from levers9.launch.run_reader import RESULTS
from levers9.launch.settings import load_settings
from levers9.launch.slurm import collect as slurm_collect
from levers9.launch.slurm import nodes as slurm_nodes
from levers9.launch.slurm import task as slurm_task
from levers9.launch.slurm.follow import POLL_S, Follower, Reaper, Tracker
from levers9.launch.slurm.nodes import SlurmPlan
from levers9.procs.failure import ship
from levers9.retries import restart_policy, run_with_retries, word_for

log = logging.getLogger("levers9.launch.slurm")



# ---- submission ------------------------------------------------------------------------------------


class SlurmBackend:
    """Submits batches to the SLURM cluster this machine is a login node of (SLURM_CONF or /etc/slurm)."""

    def submit(self, batch: Batch) -> list[Future[Any]]:
        """Check some node(s) could hold the job, submit every cell at once (one job array for several), and
        follow them; one Future per cell."""
        _check_room(batch)
        spec = batch.spec
        settings = load_settings()
        options = slurm_options.merged(spec.options_for("slurm"), settings.backend_table("slurm"))
        nodes = slurm_nodes.cluster_nodes(options.get("partition"))
        slurm_nodes.check_account_and_qos(options.get("account"), options.get("qos"))
        plan = slurm_nodes.plan_job(spec, nodes, options.get("partition"))
        func_blob = job_process.ship_for(batch.func, spec.name, "a SLURM job",
                                         "Define it at module level, with globals that can be pickled.")  # fmt: skip
        limit = int(options.get("max_running", slurm_nodes.capacity(plan, spec, nodes)))
        submitter = Submitter(batch, plan, options, batch.folder.path / "slurm", limit)
        follower = Follower(batch)
        keep = function_key(batch.func) if "detach" in options else None  # a detached job stores its value itself
        cells = [SlurmCell(batch, cell, submitter, follower, func_blob, keep) for cell in batch.cells]
        trackers = submitter.submit_all([c.payload(1) for c in cells], cells)
        for cell, tracker in zip(cells, trackers, strict=True):
            cell.first = tracker
            follower.add(tracker)
        base_id = trackers[0].job_id.split("_")[0]
        batch.cancel.on_cancel(lambda: submitter.cancel(base_id))  # one scancel for a whole array
        follower.start()
        dispatch(batch, cells, min(len(cells), 2 * limit, 64))
        return [c.future for c in cells]


def _check_room(batch: Batch) -> None:
    """JobConfigError before anything is submitted if the run folder's disk is full or over its quota: every job
    writes its output and result there (under slurm/), and would fail for it."""
    losses = batch.folder.losses
    full = losses.error if losses.unrecorded else state_files.room_for(batch.folder.path)
    if full is not None and full.errno in state_files.FULL:
        raise JobConfigError(
            f"the run folder {batch.folder.path} {state_files.why(full)}: SLURM jobs write their output and result "
            f"there (under slurm/), so nothing was submitted. Expected room for at least "
            f"{state_files.ROOM_PROBE >> 20} MiB. {state_files.MOVE_IT} that every node shares (LEVERS9_STATE_DIR="
            f"{os.environ.get('LEVERS9_STATE_DIR', '(not set: the default under your home)')})."
        )


class Submitter:
    """submitit's executor for one batch: the sbatch options of its plan, one array for the first attempts."""

    def __init__(self, batch: Batch, plan: SlurmPlan, options: dict[str, str], folder: Path, limit: int) -> None:
        self.batch, self.plan, self.folder, self.options = batch, plan, folder, options
        spec = batch.spec
        if "requeue" in options and int(options["requeue"]) < spec.stop_grace:
            raise JobConfigError(
                f"slurm={{'requeue': {options['requeue']}}} asks for SLURM's early signal {options['requeue']} s before "
                f"the time limit, less than the job's stop_grace={spec.stop_grace:g}: the tasks' grace to save would "
                f"run past the limit, where SLURM kills the job and does not requeue it. Expected requeue >= "
                f"stop_grace: raise 'requeue' (e.g. slurm={{'requeue': {math.ceil(spec.stop_grace) + 30}}}) or lower "
                f"stop_grace=."
            )
        params: dict[str, Any] = {
            "job_name": spec.name[:64],
            "nodes": plan.nodes,
            "ntasks_per_node": plan.tasks,
            "time": None if spec.timeout is None else math.ceil(spec.timeout / 60) + 1,  # a backstop: enforced here
            "array_parallelism": limit,
            "signal_delay_s": slurm_options.early_signal_s(options),  # --signal=USR2@N
            "setup": ["export SUBMITIT_LOG_LEVEL=${SUBMITIT_LOG_LEVEL:-WARNING}"],  # the job's output is the user's
            "additional_parameters": slurm_options.sbatch_options(options.get("sbatch", ""), "the sbatch option"),
        }
        if "requeue" in options:  # the early signal asks the job's tasks to stop; this line then requeues it
            params["teardown"] = [slurm_task.requeue_teardown(str(folder))]
        if plan.cards:
            params["gres"] = plan.gres  # gpu:a100:4 when @job(gpu=...) names a type
        if spec.cpu is not None:
            params["cpus_per_task"] = math.ceil(spec.cpu)
        if spec.memory_mib is not None:
            params["additional_parameters"].setdefault("mem", f"{spec.memory_mib}M")
        for key in ("partition", "account", "qos"):
            if key in options:
                params[key] = options[key]
        self.executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=0)
        self.executor.update_parameters(**params)
        self.reaper = Reaper(spec.stop_grace)

    def submit_all(self, payloads: list[TaskPayload], cells: list[SlurmCell]) -> list[Tracker]:
        """Every cell's first attempt: one job, or one job array."""
        try:
            if len(payloads) == 1:
                jobs = [self.executor.submit(slurm_task.run_task, payloads[0])]
            else:
                with self.executor.batch():
                    delayed = [self.executor.submit(slurm_task.run_task, p) for p in payloads]
                jobs = list(delayed)
        except Exception as exc:
            raise _submit_error(exc) from exc
        if "detach" not in self.options:  # detached: the caller's exit or death leaves them running
            self.reaper.add(jobs[0].job_id.split("_")[0])
        else:
            slurm_collect.mark_detached(self.folder)
        for cell, job in zip(cells, jobs, strict=True):
            slurm_collect.record(self.folder, cell.cell.index, str(job.job_id))
        return [Tracker(self, cell, str(job.job_id), 1) for cell, job in zip(cells, jobs, strict=True)]

    def submit_one(self, payload: TaskPayload, cell: SlurmCell, attempt: int) -> Tracker:
        """One more attempt of one cell, as a single job."""
        try:
            job = self.executor.submit(slurm_task.run_task, payload)
        except Exception as exc:
            raise _submit_error(exc) from exc
        if "detach" not in self.options:
            self.reaper.add(str(job.job_id))
        slurm_collect.record(self.folder, cell.cell.index, str(job.job_id))
        return Tracker(self, cell, str(job.job_id), attempt)

    def cancel(self, job_id: str) -> None:
        """Stop `job_id` (a job, an array element, or a whole array by its base id) with the job's stop_grace:
        SIGTERM to its tasks now, the kill after stop_grace s (reaper.py does both: it outlives this process)."""
        self.reaper.stop(job_id)


def _submit_error(exc: Exception) -> Exception:
    """sbatch's refusal in words the caller can act on (a bad partition, account or option)."""
    if isinstance(exc, (JobConfigError, NotShippableError)):
        return exc
    text = str(exc).strip().splitlines()
    return JobConfigError(
        f"sbatch refused the job: {' '.join(text[-3:])}. Check @job(slurm={{...}}) and the [slurm] table of "
        f"workspace.toml (partition, account, qos, sbatch options)."
    )


class SlurmCell:
    """One cell: its first attempt is already submitted (in the array); retries are single jobs."""

    def __init__(self, batch: Batch, cell: Cell, submitter: Submitter, follower: Follower,
                 func_blob: bytes, fn_key: str | None) -> None:  # fmt: skip
        self.batch, self.cell, self.submitter, self.follower = batch, cell, submitter, follower
        self.label = batch.cell_label(cell)
        self.func_blob = func_blob
        # where resume looks for this cell's value (run_folder.RunRecord.store), for a detached job to write
        self.result_path = "" if fn_key is None else str(batch.folder.path / RESULTS / f"{cell_key(fn_key, cell)}.pkl")
        self.first: Tracker | None = None
        self.current: Tracker | None = None
        try:
            self.arguments = ship((cell.args, dict(cell.kwargs)))
        except Exception as exc:
            raise NotShippableError(
                f"the arguments of {self.label} {cell.describe()} cannot be pickled ({type(exc).__name__}: {exc}); "
                f"pass plain data, or a path to a file."
            ) from exc
        self.future: Future[Any] = Future()
        self.future.add_done_callback(self._on_done)

    def payload(self, attempt: int, restart: int = 0) -> TaskPayload:
        return TaskPayload(
            tuple(p for p in sys.path if p), self.func_blob, self.arguments, self.batch.spec, self.batch.run_id,
            self.cell.index, attempt, tasks=self.submitter.plan.nodes * self.submitter.plan.tasks, restart=restart,
            requeue="requeue" in self.submitter.options, folder=str(self.submitter.folder),
            result_path=self.result_path, secret=secrets.token_hex(16),
        )  # fmt: skip

    def _on_done(self, future: Future[Any]) -> None:
        self.follower.cell_over()
        if future.cancelled() and not self.batch.cancel.cancelled:  # a cancelled batch is one scancel
            for tracker in (self.first, self.current):
                if tracker is not None and not tracker.done.is_set():
                    self.submitter.cancel(tracker.job_id)

    def stopped(self) -> bool:
        return self.batch.cancel.cancelled or self.future.cancelled()

    def take_place(self) -> None:
        pass

    def run(self) -> None:
        outcomes.attempt_cell(self.batch, self.cell, self.future, self._attempt, log)
        if self.first is not None and not self.first.done.is_set():  # never run: a cancelled map's queued cell
            self.submitter.cancel(self.first.job_id)

    def _attempt(self, attempt: int) -> Any:
        """One attempt of the cell (what retries= counts). For a job across nodes, SLURM's srun is the launcher of
        every rank, so a restart (max_restarts=) is the job submitted again, its ranks' TORCHELASTIC_RESTART_COUNT
        one higher, after a failure of a kind distributed.run restarts on; a job of one node restarts its ranks
        itself, inside the job, as on a workstation."""
        spec = self.batch.spec
        if self.submitter.plan.nodes == 1 or not spec.max_restarts:
            return self._job(attempt, 0)

        def restarting(number: int, exc: BaseException, kind: FailureKind) -> bool:
            if self.stopped():
                return False
            log.info("%s: %s; every rank starts again as a new SLURM job (restart %d of %d)", self.label,
                     word_for(kind), number, spec.max_restarts)  # fmt: skip
            return True

        def pause(seconds: float) -> None:
            self.batch.cancel.wait(seconds)

        policy = restart_policy(spec.max_restarts, None, None)
        return run_with_retries(policy, lambda number: self._job(attempt, number - 1), kind_of_error=outcomes.failure_kind,
                                before_retry=restarting, wait=pause)  # fmt: skip

    def _job(self, attempt: int, restart: int) -> Any:
        """Restart `restart` of attempt `attempt`, as one SLURM job: its value, or its failure raised."""
        if self.stopped():
            raise Cancelled()
        if attempt == 1 and restart == 0 and self.first is not None:
            tracker = self.first  # submitted in the array, followed since
        else:
            tracker = self.submitter.submit_one(self.payload(attempt, restart), self, attempt)
            self.follower.add(tracker)
        self.current = tracker
        unregister = self.batch.cancel.on_cancel(lambda: self.submitter.cancel(tracker.job_id))
        spec = self.batch.spec
        deadline = None if spec.queue_timeout is None else time.monotonic() + spec.queue_timeout
        try:
            while not tracker.started.wait(POLL_S):
                if self.stopped():
                    self.submitter.cancel(tracker.job_id)
                if deadline is not None and time.monotonic() > deadline:
                    self.submitter.cancel(tracker.job_id)
                    raise outcomes.queue_timed_out(self.label, spec.queue_timeout, "SLURM to start it",
                                                   f"SLURM job {tracker.job_id} is {tracker.state}, reason "
                                                   f"{tracker.reason or 'none given'}")  # fmt: skip
            if attempt == 1 and restart == 0 and not self.future.set_running_or_notify_cancel():
                self.submitter.cancel(tracker.job_id)
                raise Cancelled()
            self.batch.events.started(self.cell, self.submitter.plan.where(tracker.node, tracker.job_id), attempt)
            tracker.done.wait()
            return tracker.outcome()
        finally:
            unregister()
