"""The SLURM backend: the same @job cells as SLURM jobs, submitted with submitit from a login node.

    @job(gpu_count=1, backend="slurm", slurm={"partition": "gpu"})   # or LEVERS9_BACKEND=slurm
    train.map(configs)        # ONE job array, at most `max_running` cells at once (#SBATCH --array=0-N%M)
    big.remote(cfg)           # @job(gpu_count=8) on 4-card nodes: 2 nodes x 4 tasks, started by srun

submitit (the field's choice) writes the pickles and the sbatch script, submits single jobs and job
arrays, and runs each task through `python -m submitit.core._submit` under srun. It reads job states
with sacct, which needs SLURM's accounting database; this backend reads squeue instead (every cluster
has it), and follows each job by itself: its state and node, its output files (streamed to the caller
as they grow, with the local backend's prefixes), and the result file of each task
(slurm_task.TaskReport). A gpu_count no node holds is one training across the fewest nodes with equal
shares (`--nodes`, `--ntasks-per-node`, `--gres=gpu:share`), each task a rank of `distributed.run`.

`timeout=` is the job's SLURM time limit (rounded up to whole minutes, plus one) and is enforced here to
the second from the moment the job runs (then scancel and JobTimeout). A cancel (Ctrl-C, SIGTERM,
leaving a map) is scancel; if this process dies without one, slurm_reaper.py cancels its jobs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

import submitit
from submitit.core import utils as submitit_utils

from levers9 import state_files
from levers9.errors import (
    FailureKind,
    JobConfigError,
    JobCrashed,
    JobFailure,
    JobTimeout,
    NotShippableError,
)
from levers9.launch import job_process, outcomes, runs, slurm_nodes, slurm_options, slurm_task
from levers9.launch.backend import Batch
from levers9.launch.cells import Cell
from levers9.launch.lanes import dispatch
from levers9.launch.outcomes import Cancelled, OutputTail
from levers9.launch.settings import load_settings
from levers9.launch.slurm_nodes import SlurmPlan
from levers9.procs.failure import ship
from levers9.procs.outcome import Outcome
from levers9.state_files import AppendLog

log = logging.getLogger("levers9.launch.slurm")

POLL_S = 0.25  # seconds between reads of the live jobs' output and result files
STATES_EVERY_S = 1.0  # seconds between squeue calls (each one costs slurmctld an RPC)
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED", "SPECIAL_EXIT", "REVOKED"}  # fmt: skip
RUNNING = {"RUNNING", "COMPLETING", "STOPPED", "SUSPENDED", "SIGNALING", "STAGE_OUT"} | ENDED
ROOT_WAIT_S = 3.0  # how long reports of a lost peer wait for the report of the rank that failed first
REAPER = Path(__file__).with_name("slurm_reaper.py")


# ---- submission ------------------------------------------------------------------------------------


class SlurmBackend:
    """Submits batches to the SLURM cluster this machine is a login node of (SLURM_CONF or /etc/slurm)."""

    def submit(self, batch: Batch) -> list[Future[Any]]:
        """Check some node(s) could hold the job, submit every cell at once (one job array for several), and
        follow them; one Future per cell."""
        spec = batch.spec
        settings = load_settings()
        options = slurm_options.merged(spec.slurm, {k: getattr(settings, k) for k in slurm_options.SETTING_KEYS})
        nodes = slurm_nodes.cluster_nodes(options.get("partition"))
        plan = slurm_nodes.plan_job(spec, nodes, options.get("partition"))
        func_blob = job_process.ship_for(batch.func, spec.name, "a SLURM job",
                                         "Define it at module level, with globals that can be pickled.")  # fmt: skip
        run_dir = runs.run_folder(batch.run_id)
        limit = int(options.get("max_running", slurm_nodes.capacity(plan, spec, nodes)))
        submitter = _Submitter(batch, plan, options, run_dir / "slurm", limit)
        follower = _Follower(batch)
        cells = [_SlurmCell(batch, cell, submitter, follower, run_dir, func_blob) for cell in batch.cells]
        trackers = submitter.submit_all([c.payload(1) for c in cells], cells)
        for cell, tracker in zip(cells, trackers, strict=True):
            cell.first = tracker
            follower.add(tracker)
        base_id = trackers[0].job_id.split("_")[0]
        batch.cancel.on_cancel(lambda: submitter.cancel(base_id))  # one scancel for a whole array
        follower.start()
        dispatch(batch, cells, min(len(cells), 2 * limit, 64))
        return [c.future for c in cells]


class _Submitter:
    """submitit's executor for one batch: the sbatch options of its plan, one array for the first attempts."""

    def __init__(self, batch: Batch, plan: SlurmPlan, options: dict[str, str], folder: Path, limit: int) -> None:
        self.batch, self.plan, self.folder = batch, plan, folder
        spec = batch.spec
        params: dict[str, Any] = {
            "job_name": spec.name[:64],
            "nodes": plan.nodes,
            "ntasks_per_node": plan.tasks,
            "time": None if spec.timeout is None else math.ceil(spec.timeout / 60) + 1,  # a backstop: enforced here
            "array_parallelism": limit,
            "signal_delay_s": 60,
            "setup": ["export SUBMITIT_LOG_LEVEL=${SUBMITIT_LOG_LEVEL:-WARNING}"],  # the job's output is the user's
            "additional_parameters": slurm_options.sbatch_options(options.get("sbatch", ""), "the sbatch option"),
        }
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
        self.reaper = _Reaper(spec.stop_grace)

    def submit_all(self, payloads: list[dict[str, Any]], cells: list[_SlurmCell]) -> list[_Tracker]:
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
        self.reaper.add(jobs[0].job_id.split("_")[0])
        return [_Tracker(self, cell, str(job.job_id), 1) for cell, job in zip(cells, jobs, strict=True)]

    def submit_one(self, payload: dict[str, Any], cell: _SlurmCell, attempt: int) -> _Tracker:
        """One more attempt of one cell, as a single job."""
        try:
            job = self.executor.submit(slurm_task.run_task, payload)
        except Exception as exc:
            raise _submit_error(exc) from exc
        self.reaper.add(str(job.job_id))
        return _Tracker(self, cell, str(job.job_id), attempt)

    def cancel(self, job_id: str) -> None:
        """Stop `job_id` (a job, an array element, or a whole array by its base id) with the job's stop_grace:
        SIGTERM to its tasks now, the kill after stop_grace s (slurm_reaper.py does both: it outlives this process)."""
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


class _Reaper:
    """The helper process that cancels this batch's jobs if this process dies first (slurm_reaper.py)."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None

    def _pipe(self) -> IO[str] | None:
        if self._proc is None:
            self._proc = subprocess.Popen(
                [sys.executable, str(REAPER), str(self.grace)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, text=True, start_new_session=True, close_fds=True,
            )  # fmt: skip
        return self._proc.stdin

    def _say(self, line: str) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            pipe = self._pipe()
            if pipe is not None:
                pipe.write(line + "\n")
                pipe.flush()

    def add(self, job_id: str) -> None:
        self._say(f"+{job_id}")

    def remove(self, job_id: str) -> None:
        self._say(f"-{job_id}")

    def stop(self, job_id: str) -> None:
        self._say(f"!{job_id}")

    def close(self) -> None:
        """Nothing more to watch: the helper exits once the stops it was asked for are done (it cancels nothing
        that was removed)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(self.grace + 60)


# ---- following jobs --------------------------------------------------------------------------------


@dataclasses.dataclass
class _Stream:
    """One output file of one task, read as it grows."""

    path: Path
    stream: str
    prefix: str
    offset: int = 0
    partial: bytes = b""

    def read(self) -> list[str]:
        """The complete lines added since the last read."""
        try:
            with open(self.path, "rb") as file:
                file.seek(self.offset)
                data = file.read(1 << 20)
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        return [line.decode("utf-8", "replace") for line in lines]


class _Tracker:
    """One submitted job (or array element) of one cell's attempt, until it ends: its state, output and reports."""

    def __init__(self, submitter: _Submitter, cell: _SlurmCell, job_id: str, attempt: int) -> None:
        self.submitter, self.cell, self.job_id, self.attempt = submitter, cell, job_id, attempt
        batch = submitter.batch
        self.run = outcomes.JobAttempt.begin(cell.run_dir, cell.label, cell.cell.index, attempt, batch.spec)
        self.tail = OutputTail()
        tasks = submitter.plan.nodes * submitter.plan.tasks
        folder = submitter.folder
        self.streams = [
            _Stream(folder / f"{job_id}_{t}_log.{ext}", stream, f"[node {t}] " if t else "")  # node 0: every rank's
            for t in range(tasks)
            for ext, stream in (("out", "stdout"), ("err", "stderr"))
        ]
        self.results = [folder / f"{job_id}_{t}_result.pkl" for t in range(tasks)]
        self.state, self.reason, self.node = "PENDING", "", ""
        self.started_at: float | None = None
        self.started = threading.Event()
        self.done = threading.Event()
        self.report: slurm_task.TaskReport | None = None
        self.ended_state = ""  # SLURM's state when the job ended without a report
        self.timed_out = False
        self.peer_loss_at: float | None = None  # when a rank first reported losing a peer
        self.died: tuple[str, str, str] | None = None  # (node, tasks, how) of srun's "task N: Killed" line
        self.requeued = False  # SLURM requeued the job (scontrol requeue, preemption): its kills are not deaths
        self.queued_again = False  # ... and it was seen queued since
        self.ended_polls = 0
        self.logs: dict[str, AppendLog] = {}

    def poll(self, states: dict[str, tuple[str, str, str]] | None) -> None:
        """Read what is new (output, state, reports); set `done` when the job's outcome is known."""
        self._read_output()
        state = None if states is None else states.get(self.job_id)
        if state is not None:
            reason_before = self.reason
            self.state, self.reason, node = state
            self.node = node or self.node
            if self.state == "PENDING" and self.reason != reason_before:
                self.submitter.batch.events.waiting(self.cell.cell, slurm_nodes.pending_words(self.submitter.plan, self.reason))
            if self.requeued and self.state not in RUNNING:
                self.queued_again = True
            elif self.requeued and self.queued_again:  # running again: resumes, as the user's checkpoint allows
                self.requeued = self.queued_again = False
        if self.started_at is None and (self.state in RUNNING or any(p.exists() for p in self.results)
                                        or any(stream.offset for stream in self.streams)):
            self.started_at = time.monotonic()
            self.started.set()
        reports = sorted(self._reports(), key=lambda r: r.rank)
        failed = [r for r in reports if r.failure is not None]
        roots = [r for r in failed if r.failure is not None and not r.failure.peer_loss]
        if failed and self.peer_loss_at is None:
            self.peer_loss_at = time.monotonic()
        if not roots and self.died is not None:  # a rank died without a report (a signal): it is the news,
            self.submitter.cancel(self.job_id)  # not the peers that lost it
            self._end(None)
            return
        lost_long_ago = self.peer_loss_at is not None and time.monotonic() - self.peer_loss_at > ROOT_WAIT_S
        if roots or (failed and (self.state in ENDED or lost_long_ago)):
            self._end((roots or failed)[0])  # the rank that failed first, not the peers that lost it
            return
        if not failed and reports and reports[0].rank == 0:
            self._end(reports[0])
            return
        timeout = self.submitter.batch.spec.timeout
        if self.started_at is not None and timeout is not None and time.monotonic() - self.started_at > timeout:
            self.timed_out = True
            self.submitter.cancel(self.job_id)
            self._end(None)
            return
        if states is not None and (state is None or self.state in ENDED):
            self.ended_polls += 1  # the result file is written before the task exits: one more look, then over
            if self.ended_polls > 2:
                self.ended_state = self.state if state is not None else "gone from squeue"
                self._end(None)

    def _reports(self) -> list[slurm_task.TaskReport]:
        reports = []
        for path in self.results:
            if path.exists():
                with contextlib.suppress(Exception):
                    status, value = submitit_utils.pickle_load(path)
                    if status == "success" and isinstance(value, slurm_task.TaskReport):
                        reports.append(value)
        return reports

    def _read_output(self) -> None:
        events, cell = self.submitter.batch.events, self.cell.cell
        losses = state_files.losses(self.cell.run_dir)
        for stream in self.streams:
            for line in stream.read():
                if "DUE TO JOB REQUEUE" in line or "DUE TO PREEMPTION" in line:
                    self.requeued = True
                elif not self.requeued and self.died is None:
                    self.died = _srun_error(line)
                if stream.stream not in self.logs:
                    self.logs[stream.stream] = AppendLog(self.run.job_dir / f"{stream.stream}.log", losses)
                self.logs[stream.stream].write((stream.prefix + line + "\n").encode())
                self.tail.add(stream.prefix + line)
                if self.submitter.batch.spec.stream_output:
                    events.output(cell, stream.stream, stream.prefix + line)

    def _end(self, report: slurm_task.TaskReport | None) -> None:
        if report is not None and report.failure is not None:
            self.submitter.cancel(self.job_id)  # the other ranks would wait for the failed one
        self._read_output()
        for append_log in self.logs.values():
            append_log.close()
        self.report = report
        self.submitter.reaper.remove(self.job_id)
        self.started.set()
        self.done.set()

    def outcome(self) -> Any:
        """The attempt's value, or its exception (the job's own, JobTimeout, JobCrashed, Cancelled)."""
        spec, run, report = self.submitter.batch.spec, self.run, self.report
        where = f"{self.node or '?'} (SLURM job {self.job_id})"
        meta = {"slurm_job": self.job_id, "node": self.node, "state": self.state}
        if self.timed_out:
            run.write_meta({**meta, "attempt": run.attempt, "killed_for": "timeout"})
            raise JobTimeout(
                f"{run.label} exceeded timeout={spec.timeout:g}s ({run.attempts}); SLURM job {self.job_id} on "
                f"{self.node or '?'} was cancelled and its cards freed. Raise timeout= if it needs longer. {run.where}"
            )
        if report is None and self.died is not None and not self.cell.stopped():
            node, tasks, how = self.died
            run.write_meta({**meta, "attempt": run.attempt, "killed_for": None, "died": how})
            raise JobCrashed(
                f"{run.label}: rank(s) {tasks} on {node} {how.lower()} (srun: {how}) before returning; the other "
                f"ranks lost them and SLURM job {self.job_id} was cancelled; {run.attempts}. A rank killed by a "
                f"signal is most often the out-of-memory killer. Last output:\n{self.tail.last_output}\n{run.where}",
                JobFailure(cell=self.cell.cell.index, pid=0, output_tail=self.tail.text, kind=FailureKind.CRASH),
                kind=FailureKind.CRASH,
            )
        if report is None:
            if self.cell.stopped():
                raise Cancelled()
            run.write_meta({**meta, "attempt": run.attempt, "killed_for": None})
            kind = FailureKind.TIMEOUT if self.ended_state == "TIMEOUT" else FailureKind.CRASH
            how = "reached its SLURM time limit" if kind is FailureKind.TIMEOUT else f"ended ({self.ended_state})"
            message = (f"{run.label} (SLURM job {self.job_id} on {self.node or '?'}) {how} before returning; "
                       f"{run.attempts}. Last output:\n{self.tail.last_output}\n{run.where}")  # fmt: skip
            if kind is FailureKind.TIMEOUT:
                raise JobTimeout(message)
            raise JobCrashed(message, JobFailure(cell=self.cell.cell.index, pid=0, output_tail=self.tail.text, kind=kind), kind=kind)
        node = f"{report.node}, {'node' if self.submitter.plan.nodes > 1 else 'rank'} {report.rank} of {where}"
        outcome = Outcome(pid=report.pid, exitcode=0 if report.failure is None else 1, signal=None,
                          value=report.value, failure=report.failure, reported=True)  # fmt: skip
        return outcomes.finish(run, outcome, self.tail, spec.timeout, meta, node)


_SRUN_ERROR = re.compile(r"srun: error: (\S+): tasks? ([\d,-]+): (Killed|Segmentation fault|Aborted|Terminated|Exited with exit code \d+)")


def _srun_error(output: str) -> tuple[str, str, str] | None:
    """(node, tasks, how) from srun's own report of a task that ended badly ('srun: error: l9node2: task 3:
    Killed'), which is all SLURM says of a rank that died without a Python exception; None if there is none."""
    match = _SRUN_ERROR.search(output)
    return None if match is None else (match.group(1), match.group(2), match.group(3))


class _Follower:
    """One thread per batch: polls squeue and every live tracker until the batch is over."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.trackers: list[_Tracker] = []
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.open = len(batch.cells)  # cells not yet resolved
        self.reaper: _Reaper | None = None

    def add(self, tracker: _Tracker) -> None:
        with self.lock:
            self.trackers.append(tracker)
            self.reaper = tracker.submitter.reaper
        self.wake.set()

    def cell_over(self) -> None:
        with self.lock:
            self.open -= 1
        self.wake.set()

    def start(self) -> None:
        threading.Thread(target=self._loop, name=f"levers9-slurm-{self.batch.spec.name}", daemon=True).start()

    def _loop(self) -> None:
        asked = 0.0  # when squeue was last asked
        while True:
            with self.lock:
                live = [t for t in self.trackers if not t.done.is_set()]
                self.trackers = live
                finished = self.open == 0 and not live
            if finished:
                break
            if live:
                states = None
                if time.monotonic() - asked >= STATES_EVERY_S:
                    states, asked = _states(), time.monotonic()
                for tracker in live:
                    try:
                        tracker.poll(states)
                    except Exception as exc:  # never leave a cell waiting forever
                        log.warning("following SLURM job %s failed: %s", tracker.job_id, exc)
                        tracker.ended_state = f"not followed ({type(exc).__name__}: {exc})"
                        tracker._end(None)
            self.wake.wait(POLL_S)
            self.wake.clear()
        if self.reaper is not None:  # the helper exits once the stops it was asked for are done
            self.reaper.close()


def _states() -> dict[str, tuple[str, str, str]] | None:
    """job id ('123', '123_4' for array elements) -> (state, reason, nodes), for this user's jobs; None when
    squeue gives no answer (then nothing is concluded from a job's absence)."""
    try:
        done = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-u", str(os.getuid()), "-o", "%i|%T|%r|%N"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    states = {}
    for line in done.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 4:
            states[parts[0]] = (parts[1], parts[2], parts[3])
    return states


class _SlurmCell:
    """One cell: its first attempt is already submitted (in the array); retries are single jobs."""

    def __init__(self, batch: Batch, cell: Cell, submitter: _Submitter, follower: _Follower, run_dir: Path,
                 func_blob: bytes) -> None:  # fmt: skip
        self.batch, self.cell, self.submitter, self.follower, self.run_dir = batch, cell, submitter, follower, run_dir
        self.label = batch.cell_label(cell)
        self.func_blob = func_blob
        self.secret = secrets.token_hex(16)
        self.first: _Tracker | None = None
        self.current: _Tracker | None = None
        try:
            self.arguments = ship((cell.args, dict(cell.kwargs)))
        except Exception as exc:
            raise NotShippableError(
                f"the arguments of {self.label} {cell.describe()} cannot be pickled ({type(exc).__name__}: {exc}); "
                f"pass plain data, or a path to a file."
            ) from exc
        self.future: Future[Any] = Future()
        self.future.add_done_callback(self._on_done)

    def payload(self, attempt: int) -> dict[str, Any]:
        return {
            "sys_path": [p for p in sys.path if p],
            "func": self.func_blob,
            "arguments": self.arguments,
            "spec": self.batch.spec,
            "run_id": self.batch.run_id,
            "index": self.cell.index,
            "attempt": attempt,
            "tasks": self.submitter.plan.nodes * self.submitter.plan.tasks,
            "secret": self.secret,  # the keys of a job across nodes' control store (slurm_gang.py)
        }

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
        if self.stopped():
            raise Cancelled()
        if attempt == 1 and self.first is not None:
            tracker = self.first  # submitted in the array, followed since
        else:
            tracker = self.submitter.submit_one(self.payload(attempt), self, attempt)
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
                    raise JobTimeout(
                        f"{self.label} waited {spec.queue_timeout:g} s (queue_timeout) for SLURM to start it "
                        f"(SLURM job {tracker.job_id}: {tracker.state}, reason {tracker.reason or 'none given'}). "
                        f"Raise queue_timeout=, or leave it None to wait.",
                        kind="queue",
                    )
            if attempt == 1 and not self.future.set_running_or_notify_cancel():
                self.submitter.cancel(tracker.job_id)
                raise Cancelled()
            self.batch.events.started(self.cell, self.submitter.plan.where(tracker.node, tracker.job_id), attempt)
            tracker.done.wait()
            return tracker.outcome()
        finally:
            unregister()
