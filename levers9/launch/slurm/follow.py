"""Following and stopping a batch's SLURM jobs from the caller (backend.py submits them).

One thread per batch (`Follower`) asks squeue for every job's state once a second and reads each live job's
output files (streamed to the caller with the local backend's prefixes, kept in the attempt's logs) and its
tasks' result files (slurm_task.TaskReport); a `Tracker` per job decides when its outcome is known: rank 0's
report, the failure that came first, srun's word on a task killed by a signal, a requeue (followed into the
job's next run), the caller's timeout=. Every stop goes through `Reaper`, the caller's side of
reaper.py: SIGTERM to the job's tasks, the kill after stop_grace, even when the caller is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from submitit.core import utils as submitit_utils

from levers9 import state_files
from levers9.distributed.detect import expand_nodelist
from levers9.errors import FailureKind
from levers9.launch import outcomes
from levers9.launch.outcomes import Cancelled
from levers9.launch.slurm import nodes as slurm_nodes
from levers9.launch.slurm import task as slurm_task
from levers9.launch.slurm.collect import ENDED, queue_states
from levers9.procs.outcome import Outcome, root_cause, this_clock
from levers9.procs.supervise import ROOT_CAUSE_WINDOW_S

if TYPE_CHECKING:
    from levers9.launch.backend import Batch
    from levers9.launch.cells import Cell

log = logging.getLogger("levers9.launch.slurm")

POLL_S = 0.25  # seconds between reads of the live jobs' output and result files
STATES_EVERY_S = 1.0  # seconds between squeue calls (each one costs slurmctld an RPC)
RUNNING = {"RUNNING", "COMPLETING", "STOPPED", "SUSPENDED", "SIGNALING", "STAGE_OUT"} | ENDED
# lines of a job's output that say it is requeued: SLURM's (scontrol requeue, preemption) and task.py's own
REQUEUED_WORDS = ("DUE TO JOB REQUEUE", "DUE TO PREEMPTION", slurm_task.REQUEUE_WORDS)
REQUEUE_WAIT_POLLS = 60  # squeue answers (about a second apart) a requeued job may show as ended
ROOT_WAIT_S = 3.0  # how long reports of a lost peer wait for the report of the rank that failed first
# after the first report of a failure of its own, how long an earlier one on its way (written, not yet read) is awaited
ROOT_WINDOW_S = ROOT_CAUSE_WINDOW_S + 2 * POLL_S
REAPER = Path(__file__).with_name("reaper.py")


class Reaper:
    """The helper process that cancels this batch's jobs if this process dies first (reaper.py)."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._closed = False

    def _pipe(self) -> IO[str] | None:
        if self._proc is None:
            self._proc = subprocess.Popen(
                [sys.executable, str(REAPER), str(self.grace)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, text=True, start_new_session=True, close_fds=True,
            )  # fmt: skip
        return self._proc.stdin

    def _say(self, line: str) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            if self._closed and not line.startswith("!"):
                return  # nothing is watched any more: a job that ends after the close needs no word
            pipe = self._pipe()
            if pipe is not None:
                pipe.write(line + "\n")
                pipe.flush()
                if self._closed:  # a stop asked after the close: a helper of its own does it, then exits
                    pipe.close()
                    self._proc = None

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
            proc, self._proc, self._closed = self._proc, None, True
        if proc is not None and proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(self.grace + 60)


@dataclasses.dataclass
class Stream:
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


class Submitting(Protocol):
    """What a Tracker needs of the batch's submitter (slurm_backend.Submitter)."""

    batch: Batch
    plan: slurm_nodes.SlurmPlan
    folder: Path
    reaper: Reaper

    def cancel(self, job_id: str) -> None: ...


class FollowedCell(Protocol):
    """What a Tracker needs of the cell it follows (slurm_backend.SlurmCell)."""

    cell: Cell
    label: str

    def stopped(self) -> bool: ...


class Tracker:
    """One submitted job (or array element) of one cell's attempt, until it ends: its state, output and reports."""

    def __init__(self, submitter: Submitting, cell: FollowedCell, job_id: str, attempt: int) -> None:
        self.submitter, self.cell, self.job_id, self.attempt = submitter, cell, job_id, attempt
        batch = submitter.batch
        self.run = outcomes.JobAttempt.begin(batch, cell.label, cell.cell, attempt)
        tasks = submitter.plan.nodes * submitter.plan.tasks
        folder = submitter.folder
        self.streams = [
            Stream(folder / f"{job_id}_{t}_log.{ext}", stream, f"[rank {t}] " if t else "")
            for t in range(tasks)
            for ext, stream in (("out", "stdout"), ("err", "stderr"))
        ]
        self.results = [folder / f"{job_id}_{t}_result.pkl" for t in range(tasks)]
        self.state, self.reason, self.node = "PENDING", "", ""
        self.placed_on = ""  # the job's node list as it started: squeue drops a failed node from it afterwards
        self.started_at: float | None = None
        self.started = threading.Event()
        self.done = threading.Event()
        self.report: slurm_task.TaskReport | None = None
        self.ended_state = ""  # SLURM's state when the job ended without a report
        self.timed_out = False
        self.failed_at: float | None = None  # when a rank's failure was first read (of any kind)
        self.own_failure_at: float | None = None  # when a failure of its own (not a lost peer) was first read
        self.died: tuple[str, str, str] | None = None  # (node, tasks, how) of srun's "task N: Killed" line
        self.said: SlurmSaid | None = None  # slurmstepd's "*** JOB ... CANCELLED AT ... ***" line, if it ended the job
        self.oom_said = ""  # SLURM's own line on an out-of-memory kill in the job's cgroup
        self.hint = ""  # what to change, said after the attempts when the ending calls for it
        self.failed_node = ""  # the node srun says failed ('srun: error: Node failure on l9node2')
        self.srun_tasks: dict[str, str] = {}  # node -> its tasks (ranks), from srun's lines on tasks that ended badly
        self.requeued = False  # SLURM requeued the job (scontrol requeue, preemption): its kills are not deaths
        self.queued_again = False  # ... and it was seen queued since
        self.ended_polls = 0

    def poll(self, states: dict[str, tuple[str, str, str]] | None) -> None:
        """Read what is new (output, state, reports); set `done` when the job's outcome is known."""
        self._read_output()
        state = None if states is None else states.get(self.job_id)
        if state is not None:
            reason_before = self.reason
            self.state, self.reason, node = state
            self.node = node or self.node
            self.placed_on = self.placed_on or (node if self.state == "RUNNING" else "")
            if self.state == "PENDING" and self.reason != reason_before:
                self.submitter.batch.events.waiting(self.cell.cell, slurm_nodes.pending_words(self.submitter.plan, self.reason))
            if self.requeued and self.state not in RUNNING:
                self.queued_again = True
            elif self.requeued and self.queued_again:  # running again: resumes, as the user's checkpoint allows
                self.requeued = self.queued_again = False
                self.said, self.oom_said, self.failed_node, self.srun_tasks = None, "", "", {}
                self.placed_on = ""  # a new allocation
        if self.started_at is None and (self.state in RUNNING or any(p.exists() for p in self.results)
                                        or any(stream.offset for stream in self.streams)):
            self.started_at = time.monotonic()
            self.started.set()
        if self.timed_out:  # stopped for timeout=: over once SLURM says the job ended, its tasks' stop_grace had
            if states is not None and (state is None or self.state in ENDED):  # (as a local job's JobTimeout comes
                self._end(None)  # once its process is gone: a SIGTERM handler's checkpoint is there, its cards free)
            return
        reports = sorted(self._reports(), key=lambda r: r.rank)
        failed = [r for r in reports if r.failure is not None]
        own = [r for r in failed if r.failure is not None and not r.failure.peer_loss]
        now = time.monotonic()
        if failed and self.failed_at is None:
            self.failed_at = now
        if own and self.own_failure_at is None:
            self.own_failure_at = now
        if not own and self.died is not None:  # a rank died without a report (a signal): it is the news,
            self.submitter.cancel(self.job_id)  # not the peers that lost it
            self._end(None)
            return
        over = self.state in ENDED or len(reports) == len(self.results)
        own_long_ago = self.own_failure_at is not None and now - self.own_failure_at >= ROOT_WINDOW_S
        failed_long_ago = self.failed_at is not None and now - self.failed_at > ROOT_WAIT_S
        if failed and (over or own_long_ago or failed_long_ago):
            self._end(_root_report(failed))  # the rank that failed first, not the peers that lost it
            return
        if not failed and reports and reports[0].rank == 0:
            self._end(reports[0])
            return
        timeout = self.submitter.batch.spec.timeout
        if self.started_at is not None and timeout is not None and time.monotonic() - self.started_at > timeout:
            self.timed_out = True
            self.submitter.cancel(self.job_id)
            return
        if states is not None and (state is None or self.state in ENDED):
            self.ended_polls += 1  # the result file is written before the task exits: one more look, then over
            # (a requeued job may show its run's end for a while before SLURM queues it again)
            if self.ended_polls > (REQUEUE_WAIT_POLLS if self.requeued else 2):
                self.ended_state = self.state if state is not None else "gone from squeue"
                self._end(None)
        elif states is not None:
            self.ended_polls = 0

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
        for stream in self.streams:
            for line in stream.read():
                said = slurm_said(line)
                if said is not None and self.died is None and (self.said is None or said.job > self.said.job):
                    self.said = said  # the job's line rather than its step's; never levers9's cancel after a death
                if not self.oom_said and _SLURM_OOM.search(line):
                    self.oom_said = line.strip()
                if (lost := _NODE_FAILURE.search(line)) is not None and not self.failed_node:
                    self.failed_node = lost.group(1)
                if (ended := srun_error(line)) is not None:
                    self.srun_tasks.setdefault(ended[0], ended[1])
                if any(word in line for word in REQUEUED_WORDS):
                    self.requeued = True
                elif not self.requeued and self.died is None:
                    self.died = srun_error(line)
                self.run.output(stream.stream, stream.prefix + line + "\n")

    def _end(self, report: slurm_task.TaskReport | None) -> None:
        if report is not None and report.failure is not None:
            self.submitter.cancel(self.job_id)  # the other ranks would wait for the failed one
        self._read_output()
        self.run.close()
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
            raise outcomes.timed_out(run, spec.timeout, f"SLURM job {self.job_id} on {self.node or '?'} was cancelled")
        if report is None:
            if self.cell.stopped():
                raise Cancelled()
            run.write_meta({**meta, "attempt": run.attempt, "killed_for": None,
                            **({"died": self.died[2]} if self.died is not None else {})})  # fmt: skip
            kind, how = self._ending()
            raise outcomes.ended_without_outcome(run, f" (SLURM job {self.job_id} on {self.node or '?'})", how, kind, oom_killed=bool(self.oom_said) or self.ended_state == "OUT_OF_MEMORY",
                                                 hint=self.hint)  # fmt: skip
        node = f"{report.node} as rank {report.rank} of {where}"
        outcome = Outcome(pid=report.pid, exitcode=0 if report.failure is None else 1, signal=None,
                          value=report.value, failure=report.failure, reported=True)  # fmt: skip
        return outcomes.finish(run, outcome, spec.timeout, meta, node)

    def _ending(self) -> tuple[FailureKind, str]:
        """How a job that reported nothing ended, in SLURM's own words first (its state, slurmstepd's CANCELLED
        line, its cgroup's oom-kill line), srun's word on a killed task after; out of memory only when SLURM says so."""
        state, said = self.ended_state, self.said
        due = said.due if said is not None else ""
        quoted = f" (SLURM: {said.line})" if said is not None else f" (SLURM state {state})" if state else ""
        ranks = f"; its rank(s) {self.died[1]} on {self.died[0]} were killed" if self.died is not None else ""
        if due == "TIME LIMIT" or state == "TIMEOUT":
            return FailureKind.TIMEOUT, f"reached its SLURM time limit{quoted}"
        if due == "PREEMPTION" or state == "PREEMPTED":
            return FailureKind.LOST, f"was preempted by SLURM (a job of higher priority took its node){quoted}{ranks}"
        if due.startswith("NODE FAIL") or state == "NODE_FAIL" or self.failed_node:
            node = self.failed_node or (said.node if said is not None else self.node or "?")
            ranks_there = self.srun_tasks.get(node) or self._ranks_on(node)
            on_it = f" (its rank(s) {ranks_there})" if ranks_there else ""
            srun = f" (srun: Node failure on {self.failed_node})" if self.failed_node else ""
            return FailureKind.LOST, (f"lost its node {node}{on_it}, which SLURM marked failed{srun}{quoted}; the "
                                      f"other ranks were stopped with it")  # fmt: skip
        full = state_files.room_for(self.submitter.folder)
        if full is not None:  # what the job could not write there (its result, its output) cost it
            for half_written in self.submitter.folder.glob(f"{self.job_id}_*.save_tmp"):
                with contextlib.suppress(OSError):
                    half_written.unlink()
            self.hint = (f" {state_files.MOVE_IT} that every node shares (LEVERS9_STATE_DIR="
                         f"{os.environ.get('LEVERS9_STATE_DIR', '(not set: the default under your home)')}), then run it "
                         f"again.")  # fmt: skip
            return FailureKind.CRASH, (f"ended ({state or 'no state'}) without a result it could write, its run folder "
                                       f"{self.submitter.folder} {state_files.why(full)},")  # fmt: skip
        if self.oom_said or state == "OUT_OF_MEMORY":
            where = f"rank(s) {self.died[1]} on {self.died[0]}" if self.died is not None else "a task"
            memory = f"; raise memory= (now {self.submitter.batch.spec.memory_mib} MiB)" \
                if self.submitter.batch.spec.memory_mib else ""  # fmt: skip
            return FailureKind.CRASH, (f"ran out of memory: {where} killed by the out-of-memory killer "
                                       f"(SLURM: {self.oom_said or 'OUT_OF_MEMORY'}){memory}")  # fmt: skip
        if said is not None:
            who = f" {said.more}" if "by" in said.more.split() else " (scancel: by a user, an admin or a script; not by levers9)"
            return FailureKind.CRASH, f"was cancelled in SLURM{who} at {said.at}{quoted}"
        if self.died is not None:
            node, tasks, how = self.died
            ended = f"killed by {SRUN_SIGNALS[how]}" if how in SRUN_SIGNALS else how.lower()
            return FailureKind.CRASH, (f"had rank(s) {tasks} on {node} {ended} (srun: {how}) with no word from SLURM on "
                                       f"why (no CANCELLED line, no oom-kill event: see that node's kernel log); the "
                                       f"other ranks lost them and the job was cancelled")  # fmt: skip
        return FailureKind.CRASH, f"ended ({state or 'no state'})"


    def _ranks_on(self, node: str) -> str:
        """The ranks SLURM placed on `node` ('2-3'), from the job's node list and its tasks per node (srun's block
        placement: the first node's tasks are ranks 0 to n-1); '' if the node is not one of the job's."""
        with contextlib.suppress(Exception):
            nodes = expand_nodelist(self.placed_on or self.node)
            if node in nodes:
                per = self.submitter.plan.tasks
                first = nodes.index(node) * per
                return f"{first}-{first + per - 1}" if per > 1 else str(first)
        return ""


def _root_report(failed: list[slurm_task.TaskReport]) -> slurm_task.TaskReport:
    """The report of the root cause among failed ranks, by the core's rule (procs.outcome.root_cause: a failure of
    its own before a lost peer, then the first in time), their times taken from each node's wall clock."""
    ended = [Outcome(r.pid, 1, None, failure=r.failure if r.failure is None or r.wall is None else
                     dataclasses.replace(r.failure, when=this_clock(r.wall)), reported=True) for r in failed]  # fmt: skip
    return failed[ended.index(root_cause(ended))]


@dataclasses.dataclass(frozen=True)
class SlurmSaid:
    """slurmstepd's own line on a job or step it ended: where, when, why (its DUE TO), by whom if it says."""

    line: str
    job: bool  # the job's line (its step's says the same of the step)
    node: str
    at: str
    due: str  # "" for a cancel (scancel); "TIME LIMIT", "PREEMPTION", "NODE FAILURE", "JOB REQUEUE", ...
    more: str  # its words after those, if any


# '*** JOB 5 ON l9node1 CANCELLED AT 2026-12-06T22:50:22 ***', with ' DUE TO TIME LIMIT' (PREEMPTION, NODE FAILURE,
# JOB REQUEUE) when SLURM itself ended it, and more words after a comma (', SEE SLURMCTLD LOG FOR DETAILS', or who
# cancelled it where a SLURM version says)
_SLURM_CANCELLED = re.compile(r"\*\*\* (JOB|STEP) \S+ ON (\S+) CANCELLED AT (\S+)(?: DUE TO ([A-Z][A-Z_ ]*[A-Z]))?,?(.*?) \*\*\*")
# SLURM's cgroup plugin: 'Detected 1 oom_kill event in StepId=5.0. Some of the step tasks have been OOM Killed.'
_SLURM_OOM = re.compile(r"Detected \d+ oom[-_]kill events?")
# srun, when a node of the job's step is lost: 'srun: error: Node failure on l9node2'
_NODE_FAILURE = re.compile(r"srun: error: Node failure on (\S+)")


def slurm_said(line: str) -> SlurmSaid | None:
    """slurmstepd's CANCELLED line in `line`, parsed; None if there is none."""
    match = _SLURM_CANCELLED.search(line)
    if match is None:
        return None
    return SlurmSaid(match.group(0), match.group(1) == "JOB", match.group(2), match.group(3), match.group(4) or "",
                     match.group(5).strip())


# srun's words for a task ended by a signal (the strsignal text of slurmstepd) -> the signal's name
SRUN_SIGNALS = {"Killed": "SIGKILL", "Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Terminated": "SIGTERM"}
_SRUN_ERROR = re.compile(r"srun: error: (\S+): tasks? ([\d,-]+): (Killed|Segmentation fault|Aborted|Terminated|Exited with exit code \d+)")


def srun_error(output: str) -> tuple[str, str, str] | None:
    """(node, tasks, how) from srun's own report of a task that ended badly ('srun: error: l9node2: task 3:
    Killed'), which is all SLURM says of a rank that died without a Python exception; None if there is none."""
    match = _SRUN_ERROR.search(output)
    return None if match is None else (match.group(1), match.group(2), match.group(3))


class Follower:
    """One thread per batch: polls squeue and every live tracker until the batch is over."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.trackers: list[Tracker] = []
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.open = len(batch.cells)  # cells not yet resolved
        self.reaper: Reaper | None = None

    def add(self, tracker: Tracker) -> None:
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
                    states, asked = queue_states(), time.monotonic()
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
