"""Following and stopping a batch's SLURM jobs from the caller (backend.py submits them).

One thread per batch (`Follower`) asks squeue for every job's state once a second and reads each live job's
output files (streamed to the caller with the local backend's prefixes, kept in the attempt's logs) and its
tasks' result files (job_process.TaskEnded); a `Tracker` per job follows it through a requeue into its next
run, and while it runs steps the one Supervisor over its tasks (`SlurmRank`: each one's report, srun's word
on a task killed by a signal, the job's end), which decides when the outcome is known and which rank is its
root cause, as on every path. Every stop goes through `Reaper`, the caller's side of reaper.py: SIGTERM to
the job's tasks, the kill after stop_grace, even when the caller is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from submitit.core import utils as submitit_utils

import levers9.launch.slurm as slurm_options
from levers9 import state_files
from levers9.distributed.detect import expand_nodelist
from levers9.errors import FailureKind
from levers9.launch import outcomes
from levers9.launch.job_process import TaskEnded
from levers9.launch.outcomes import Cancelled
from levers9.launch.slurm import nodes as slurm_nodes
from levers9.launch.slurm import task as slurm_task
from levers9.launch.slurm.collect import ENDED, queue_states
from levers9.procs.failure import FailureRecord
from levers9.procs.outcome import StopReason, root_cause, this_clock
from levers9.procs.supervise import ROOT_CAUSE_WINDOW_S, Supervisor
from levers9.procs.watch import Ended

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
    options: dict[str, str]  # the job's slurm= options over the workspace's [slurm] table
    reaper: Reaper

    def cancel(self, job_id: str) -> None: ...


class FollowedCell(Protocol):
    """What a Tracker needs of the cell it follows (slurm_backend.SlurmCell)."""

    cell: Cell
    label: str

    def stopped(self) -> bool: ...


class SlurmRank(Ended):
    """One task (rank) of a running SLURM job, as the job's Supervisor watches it: over once its result file holds
    its TaskEnded (a failure's time made this machine's), srun said it was killed, or the job ended without it."""

    result: bytes | None = None
    oom_before: int | None = None

    def __init__(self, path: Path) -> None:
        self.path, self.pid, self.rank, self.node = path, 0, -1, ""
        self.status: tuple[int | None, int | None] | None = None
        self.failure: FailureRecord | None = None
        self.reported = self.lost = False
        self.ended_at: float | None = None

    def poll(self) -> bool:
        if self.status is None and self.path.exists():
            with contextlib.suppress(Exception):  # not whole yet: read again at the next poll
                status, ended = submitit_utils.pickle_load(self.path)
                if status == "success" and isinstance(ended, TaskEnded):
                    when, outcome = this_clock(ended.time), ended.outcome
                    self.pid, self.rank, self.node, self.result, self.reported = outcome.pid, ended.rank, ended.node, outcome.value, True
                    self.failure = None if outcome.failure is None else dataclasses.replace(outcome.failure, when=when)
                    self.status, self.ended_at = (outcome.exitcode, outcome.signal), when
        return self.status is not None

    def ended_unreported(self, how: str | None) -> None:
        """It ended with no report: killed as srun says (`how`, 'Killed' or 'Exited with exit code 3'), or
        with its job (None: how is not known); a report it wrote first is read and kept."""
        if not self.poll():
            code = re.search(r"\d+$", how or "") if how is not None and how.startswith("Exited") else None
            signum = getattr(signal, SRUN_SIGNALS.get(how or "", ""), None)
            self.status = (int(code.group()), None) if code else (None, int(signum)) if signum else (None, None)
            self.lost, self.ended_at = how is None, time.monotonic()


class Tracker:
    """One submitted job (or array element) of one cell's attempt, until it ends: its state, output and reports.
    While it runs, its tasks are `SlurmRank`s of one Supervisor (the core's rules: the root-cause window, timeout=,
    the caller's cancel), whose stop is the job's cancel; a timeout or a cancel is over once SLURM says it ended."""

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
        self.ranks = [SlurmRank(path) for path in self.results]
        self.supervisor: Supervisor | None = None  # from the moment the job runs (its run, after a requeue)
        self.state, self.reason, self.node = "PENDING", "", ""
        self.placed_on = ""  # the job's node list as it started: squeue drops a failed node from it afterwards
        self.started_at: float | None = None
        self.started = threading.Event()
        self.done = threading.Event()
        self.ended_state = ""  # SLURM's state when the job ended without a report
        self.died: tuple[str, str, str] | None = None  # (node, tasks, how) of srun's "task N: Killed" line
        self.said: SlurmSaid | None = None  # slurmstepd's "*** JOB ... CANCELLED AT ... ***" line, if it ended the job
        self.oom_said = ""  # SLURM's own line on an out-of-memory kill in the job's cgroup
        self.hint = ""  # what to change, said after the attempts when the ending calls for it
        self.failed_node = ""  # the node srun says failed ('srun: error: Node failure on l9node2')
        self.srun_tasks: dict[str, str] = {}  # node -> its tasks (ranks), from srun's lines on tasks that ended badly
        self.requeued = False  # SLURM requeued the job (scontrol requeue, preemption): its kills are not deaths
        self.queued_again = False  # ... and it was seen queued since
        self.ended_polls = 0

    @property
    def stopped_for(self) -> StopReason | None:
        return None if self.supervisor is None else self.supervisor.stopped_for

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
            if self.requeued and not self.queued_again and self.state not in RUNNING:
                self.queued_again = True  # its next run comes: the old run's end is not the job's
                self.said, self.oom_said, self.failed_node, self.srun_tasks = None, "", "", {}
            elif self.requeued and self.queued_again and (self.state == "RUNNING" or self.state in ENDED):
                # its next run, which resumes as the user's checkpoint allows (one too short for squeue to show it
                # running is seen ended: its Supervisor reads its report, or srun's word on its death)
                self.requeued = self.queued_again = False
                self.placed_on = ""  # a new allocation
                self.ranks, self.supervisor = [SlurmRank(path) for path in self.results], None
        running = self.state in RUNNING or any(p.exists() for p in self.results) or any(s.offset for s in self.streams)
        if self.started_at is None and running:
            self.started_at = time.monotonic()
            self.started.set()
        if self.supervisor is None and running and not self.requeued:
            self.supervisor = self._supervise()
        ended = states is not None and (state is None or self.state in ENDED)
        over = self.supervisor is not None and self.supervisor.step(0)
        if self.stopped_for in (StopReason.TIMEOUT, StopReason.CANCEL):  # over once SLURM says the job ended, its
            if ended:  # tasks' stop_grace had (as a local job's JobTimeout comes once its process is gone: a
                self._end()  # SIGTERM handler's checkpoint is there, its cards free)
            return
        if over:
            self._end()
            return
        if ended:
            self.ended_polls += 1  # the result file is written before the task exits: one more look, then over
            # (a requeued job may show its run's end for a while before SLURM queues it again)
            if self.ended_polls > (REQUEUE_WAIT_POLLS if self.requeued else 2):
                self.ended_state = self.state if state is not None else "gone from squeue"
                for rank in self.ranks:
                    rank.ended_unreported(None)
                if self.supervisor is None or self.supervisor.step(0):
                    self._end()
        elif states is not None:
            self.ended_polls = 0

    def _supervise(self) -> Supervisor:
        """The job's tasks under the one Supervisor, its timeout= counted from the job's first start."""
        timeout = self.submitter.batch.spec.timeout
        assert self.started_at is not None
        return Supervisor(None, self.ranks, timeout=None if timeout is None else timeout - (time.monotonic() - self.started_at),
                          grace=self.submitter.batch.spec.stop_grace, stop_on_failure=True, should_stop=self.cell.stopped,
                          before_stop=self._stop, window=ROOT_WINDOW_S, peer_loss_window=ROOT_WAIT_S)  # fmt: skip

    def _stop(self, reason: StopReason) -> None:
        """The Supervisor's stop: the job cancelled with its stop_grace (the caller's cancel already asked for it)."""
        if reason is not StopReason.CANCEL:
            self.submitter.cancel(self.job_id)

    def _read_output(self) -> None:
        """The job's new output: kept in the attempt's logs, and what SLURM and srun say in it of how the job ends.
        A requeued run's last words (its stop, srun's lines on it) say nothing of that; lines read after a poll at
        which SLURM showed the job queued again are its next run's."""
        for stream in self.streams:
            for line in stream.read():
                self.run.output(stream.stream, stream.prefix + line + "\n")
                if any(word in line for word in REQUEUED_WORDS):  # this run's end is not the job's
                    self.requeued, self.queued_again = True, False
                elif self.requeued and not self.queued_again:
                    continue
                said = slurm_said(line)
                if said is not None and said.due != "JOB REQUEUE" and self.died is None and \
                        (self.said is None or said.job > self.said.job):  # fmt: skip
                    self.said = said  # the job's line rather than its step's; never levers9's cancel after a death
                if not self.oom_said and _SLURM_OOM.search(line):
                    self.oom_said = line.strip()
                if (lost := _NODE_FAILURE.search(line)) is not None and not self.failed_node:
                    self.failed_node = lost.group(1)
                if (ended := srun_error(line)) is not None:
                    self.srun_tasks.setdefault(ended[0], ended[1])
                if ended is not None:
                    self.died = self.died or ended
                    for rank in expand_ranks(ended[1]):  # a rank killed with no report: it is the news, not the
                        if rank < len(self.ranks):  # peers that lost it
                            self.ranks[rank].ended_unreported(ended[2])

    def _end(self) -> None:
        self._read_output()
        self.run.close()
        self.submitter.reaper.remove(self.job_id)
        self.started.set()
        self.done.set()

    def outcome(self) -> Any:
        """The attempt's value, or its exception (the job's own, JobTimeout, JobCrashed, Cancelled)."""
        spec, run = self.submitter.batch.spec, self.run
        where = f"{self.node or '?'} (SLURM job {self.job_id})"
        meta = {"slurm_job": self.job_id, "node": self.node, "state": self.state}
        if self.stopped_for is StopReason.TIMEOUT:
            run.write_meta({**meta, "attempt": run.attempt, "killed_for": "timeout"})
            raise outcomes.timed_out(run, spec.timeout, f"SLURM job {self.job_id} on {self.node or '?'} was cancelled")
        ended = self.supervisor.outcomes() if self.supervisor is not None and self.supervisor.over else []
        failed = [o for o in ended if not o.succeeded]
        root = root_cause(failed) if failed else ended[0] if ended else None
        if root is None or not root.reported or self.stopped_for is StopReason.CANCEL:
            if self.cell.stopped():
                raise Cancelled()
            run.write_meta({**meta, "attempt": run.attempt, "killed_for": None,
                            **({"died": self.died[2]} if self.died is not None else {})})  # fmt: skip
            kind, how = self._ending()
            raise outcomes.ended_without_outcome(run, f" (SLURM job {self.job_id} on {self.node or '?'})", how, kind, oom_killed=bool(self.oom_said) or self.ended_state == "OUT_OF_MEMORY",
                                                 hint=self.hint)  # fmt: skip
        rank = self.ranks[ended.index(root)]
        return outcomes.finish(run, root, spec.timeout, meta, f"{rank.node} as rank {rank.rank} of {where}")

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
            early = slurm_options.early_signal_s(self.submitter.options) if SRUN_SIGNALS.get(how) == "SIGUSR2" else 0
            if early:  # SLURM's early signal reached a run before its handler: SLURM may send it a minute early
                self.hint = (f" SIGUSR2 is SLURM's early signal before the time limit (--signal=USR2@{early}), which "
                             f"SLURM may send up to a minute early: it reached the task as it started, before the task "
                             f"had set its handler. Give the job a time limit over {early + 60} s plus its start-up "
                             f"(timeout=, or slurm={{'sbatch': '--time=MINUTES'}}).")  # fmt: skip
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


# srun's words for a task ended by a signal (slurmstepd's strsignal text, glibc's as Python's) -> the signal's name
SRUN_SIGNALS = {text: sig.name for sig in signal.Signals if (text := signal.strsignal(sig))}
_SRUN_ERROR = re.compile(r"srun: error: (\S+): tasks? ([\d,-]+): (Exited with exit code \d+|[A-Z][\w -]*\w)(?: \(core dumped\))?\s*$")


def expand_ranks(tasks: str) -> list[int]:
    """srun's task list ('3', '2-3', '0,2-3') as ranks."""
    ranks: list[int] = []
    for part in tasks.split(","):
        first, _, last = part.partition("-")
        ranks.extend(range(int(first), int(last or first) + 1))
    return ranks


def srun_error(output: str) -> tuple[str, str, str] | None:
    """(node, tasks, how) from srun's own report of a task that ended badly ('srun: error: l9node2: task 3:
    Killed'), which is all SLURM says of a rank that died without a Python exception; None if there is none."""
    match = _SRUN_ERROR.search(output)
    if match is None or not (match.group(3) in SRUN_SIGNALS or match.group(3).startswith("Exited")):
        return None
    return match.group(1), match.group(2), match.group(3)


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
                        tracker._end()
            self.wake.wait(POLL_S)
            self.wake.clear()
        if self.reaper is not None:  # the helper exits once the stops it was asked for are done
            self.reaper.close()
