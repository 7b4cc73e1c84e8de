"""A cell's attempts as the caller sees them; the same for every backend.

`JobAttempt.begin` makes one folder per attempt in the run's folder (runs.py makes that).
`attempt_cell` is the retry loop that resolves a cell's Future, retrying the failures retries= names
(`failure_kind`). `Supervision` watches one started job process until it ends, stopping it on
timeout or cancel. `timed_out` and `result` turn a finished attempt into its return value or the
exception the caller sees (JobTimeout, JobCrashed with the output's tail, or the job's own
exception with a note saying where it ran), with the same words whichever backend ran it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Any

from levers9 import state_files
from levers9.distributed.hardware import oom
from levers9.errors import JobCrashed, JobTimeout, RankFailure, RemoteError, add_note
from levers9.launch.backend import Batch
from levers9.launch.cells import Cell
from levers9.launch.spec import JobSpec
from levers9.procs.failure import Failure, rebuild, unship
from levers9.procs.watch import Child, Watcher, cut_line

TAIL_LINES = 40  # lines of a job's output kept for the message when it crashes


class Cancelled(Exception):
    """The batch (or the cell's Future) was cancelled while this cell waited or ran."""


def failure_kind(exc: BaseException) -> str:
    """What retries= matches a failed attempt on: 'timeout', 'queue', 'crash' or 'exception'."""
    if isinstance(exc, JobTimeout):
        return exc.kind
    if isinstance(exc, JobCrashed):
        return "crash"
    return "exception"


def attempt_cell(
    batch: Batch,
    cell: Cell,
    future: Future[Any],
    attempt: Callable[[int], Any],
    log: logging.Logger,
    before_retry: Callable[[], None] = lambda: None,
) -> None:
    """Call attempt(1), attempt(2), ... until one returns, fails in a way retries= does not cover, or
    raises Cancelled; resolve `future` with that. `before_retry` runs after the backoff unless the
    batch was cancelled during it. Never raises: a bug in `attempt` still resolves the Future."""
    label = batch.cell_label(cell)
    retries = batch.spec.retries
    number = 1
    try:
        while True:
            try:
                value = attempt(number)
            except Cancelled:
                if not future.cancel() and not future.done():
                    future.set_exception(CancelledError(f"{label} was cancelled"))
                return
            except BaseException as exc:
                kind = failure_kind(exc)
                stopped = batch.cancel.cancelled or future.cancelled()
                if kind in retries.on and number <= retries.max_retries and not stopped:
                    log.info(
                        "%s: %s; retrying (attempt %d of %d)",
                        label,
                        kind,
                        number + 1,
                        retries.max_retries + 1,
                    )
                    number += 1
                    batch.events.retrying(cell, number, kind)
                    if not batch.cancel.wait(retries.delay(number)):
                        before_retry()
                    continue  # the next attempt notices a cancel
                batch.events.finished(cell, False, exc)
                _settle(future, exc)
                return
            batch.events.finished(cell, True)
            future.set_result(value)
            return
    except BaseException as exc:
        if not future.done():
            _settle(future, exc)


def _settle(future: Future[Any], exc: BaseException) -> None:
    """Fail `future` with `exc` (unless the caller cancelled it while it was still queued)."""
    if not future.running() and not future.set_running_or_notify_cancel():
        return
    future.set_exception(exc)


class OutputTail:
    """The last TAIL_LINES lines of a job's output (stdout and stderr together), each ending in a newline."""

    def __init__(self) -> None:
        self._lines: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def add(self, line: str) -> None:
        """Keep `line`, cut as failure reports keep lines (a 100 MB line is never held here)."""
        self._lines.append(cut_line(line.removesuffix("\n")) + "\n")

    @property
    def text(self) -> str:
        return "".join(self._lines)

    @property
    def last_output(self) -> str:
        """The tail for a message: without trailing blank space, or '(no output)'."""
        return self.text.rstrip() or "(no output)"


@dataclasses.dataclass(frozen=True)
class JobAttempt:
    """One attempt of one cell, as the messages about it name it."""

    label: str
    index: int
    attempt: int
    allowed: int  # attempts in all: retries + 1
    job_dir: Path
    oom_before: int | None = None  # this cgroup's OOM-kill count when the attempt began

    @classmethod
    def begin(cls, run_dir: Path, label: str, index: int, attempt: int, spec: JobSpec) -> JobAttempt:
        """The attempt, with its log folder run_dir/<index>-<attempt> created (0700) if the run folder
        exists and the disk has room; what cannot be written there is counted as lost, never raised."""
        job_dir = run_dir / f"{index:04d}-{attempt}"
        try:
            job_dir.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            state_files.losses(run_dir).lost("attempt log folder", exc)
        return cls(label, index, attempt, spec.retries.max_retries + 1, job_dir, oom.oom_kills())

    @property
    def attempts(self) -> str:
        return f"attempt {self.attempt} of {self.allowed}"

    @property
    def where(self) -> str:
        return f"Logs: {self.job_dir}"

    def write_meta(self, meta: dict[str, Any]) -> None:
        """meta.json in the attempt's folder: how it ran and ended (whole or not at all; never raises)."""
        try:
            state_files.write_atomic(self.job_dir / "meta.json", json.dumps(meta, indent=1).encode())
        except FileNotFoundError:
            pass  # no folder: the run is unrecorded, or was cleaned while it ran
        except OSError as exc:
            state_files.losses(self.job_dir.parent).lost("meta.json file", exc)


def _on(node: str | None) -> str:
    return "" if node is None else f" on {node}"


def timed_out(run: JobAttempt, timeout: float | None, pid: int, node: str | None = None) -> JobTimeout:
    """The error for an attempt whose process group (pid, on `node` if not this machine) was killed
    after `timeout` seconds."""
    return JobTimeout(
        f"{run.label} exceeded timeout={timeout:g}s ({run.attempts}); its process group {pid}{_on(node)} "
        f"was killed and its cards freed. Raise timeout= if it needs longer. {run.where}"
    )


class Supervision:
    """One job process watched until it ends: stopped (SIGTERM, `grace`, SIGKILL to its whole group) when
    `timeout` passes or `should_stop()` turns true. Step it; `killed_for` says why it was stopped."""

    def __init__(self, watcher: Watcher, child: Child, timeout: float | None, grace: float,
                 should_stop: Callable[[], bool]) -> None:  # fmt: skip
        self.watcher, self.child, self.grace, self.should_stop = watcher, child, grace, should_stop
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.killed_for: str | None = None

    def step(self, wait: float) -> bool:
        """Pump for up to `wait` s; True once the job process has ended (and was stopped, if it had to be)."""
        if self.deadline is not None:
            wait = max(0.0, min(wait, self.deadline - time.monotonic()))
        self.watcher.pump(wait)
        if self.child.poll():
            self.watcher.drain()
            self.watcher.stop(0)  # whatever it left behind in its group
            return True
        if self.should_stop():
            self.killed_for = "cancel"
        elif self.deadline is not None and time.monotonic() >= self.deadline:
            self.killed_for = "timeout"
        else:
            return False
        self.watcher.stop(self.grace)
        self.watcher.drain()
        return True

    def run(self) -> None:
        """Step until the job process has ended."""
        while not self.step(0.1):
            pass


def result(
    run: JobAttempt,
    pid: int,
    status: tuple[int | None, int | None],
    outcome: tuple[bytes | None, Failure | None] | None,
    tail: OutputTail,
    node: str | None = None,
    oom_counts: tuple[int | None, int | None] | None = None,
) -> Any:
    """The value of a finished attempt; raises the job's exception with a note saying where it ran, or
    JobCrashed (how it ended, the output's tail) if it reported no outcome or called sys.exit(N).
    `oom_counts` are the OOM-kill counts (before, after) of the cgroup the job ran in when that is not
    this process's (a Ray node); by default the attempt's start count and this cgroup's now."""
    exitcode, signum = status
    value, failure = outcome if outcome is not None else (None, None)
    if outcome is None or (failure is not None and failure.is_exit):
        if failure is not None:
            exitcode = failure.exitcode
        before, after = oom_counts if oom_counts is not None else (run.oom_before, oom.oom_kills())
        how = f"was {oom.killed_by(signum, before, after)}" if signum is not None else f"exited with code {exitcode}"
        raise JobCrashed(
            f"{run.label} (pid {pid}{_on(node)}) {how} before returning; {run.attempts}. "
            f"Last output:\n{tail.last_output}\n{run.where}",
            RankFailure(rank=run.index, pid=pid, exitcode=exitcode, signal=signum, output_tail=tail.text),
        )
    if failure is None:
        return None if value is None else unship(value)
    exc = rebuild(failure) or RemoteError(failure.exc_type, failure.message, failure.traceback)
    add_note(exc, f"levers9: traceback of {run.label}, from its job process:\n{failure.traceback.rstrip()}")
    add_note(exc, f"levers9: {run.label} ran as pid {pid}{_on(node)} ({run.attempts}). {run.where}")
    raise exc
