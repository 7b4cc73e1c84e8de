"""A cell's attempts as the caller sees them; the same for every backend.

`new_run_dir` makes the run's log folder and `JobAttempt.begin` one folder per attempt in it.
`attempt_cell` is the retry loop that resolves a cell's Future, retrying the failures retries= names
(`failure_kind`). `timed_out` and `result` turn a finished attempt into its return value or the
exception the caller sees (JobTimeout, JobCrashed with the output's tail, or the job's own
exception with a note saying where it ran), with the same words whichever backend ran it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import shutil
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Any

from levers9 import oom
from levers9.errors import JobCrashed, JobTimeout, RankFailure
from levers9.launch import runner
from levers9.launch.backend import Batch
from levers9.launch.cells import Cell
from levers9.launch.settings import runs_dir
from levers9.launch.spec import JobSpec
from levers9.private_dir import private_dir

KEEP_RUNS = 50  # run folders kept under runs_dir(); older ones are removed when a new run starts
TAIL_LINES = 40  # lines of a job's output kept for the message when it crashes


class Cancelled(Exception):
    """The batch (or the cell's Future) was cancelled while this cell waited or ran."""


def new_run_dir(run_id: str) -> Path:
    """runs_dir()/run_id, created; the oldest run folders beyond KEEP_RUNS are removed first."""
    root = private_dir(runs_dir())
    with contextlib.suppress(OSError):
        old = sorted(root.iterdir(), key=lambda p: p.stat().st_mtime)
        for stale in old[: max(0, len(old) - KEEP_RUNS + 1)]:
            shutil.rmtree(stale, ignore_errors=True)
    path = root / run_id
    path.mkdir(parents=True, exist_ok=True)
    return path


def failure_kind(exc: BaseException) -> str:
    """What retries= matches a failed attempt on: 'timeout', 'queue', 'crash' or 'exception'."""
    if isinstance(exc, JobTimeout):
        return "timeout" if "exceeded timeout" in str(exc) else "queue"
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
                    if not batch.cancel.wait(retries.delay(number)):
                        before_retry()
                    continue  # the next attempt notices a cancel
                batch.events.finished(cell, False)
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
        self._lines.append(line if line.endswith("\n") else line + "\n")

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
        """The attempt, with its log folder run_dir/<index>-<attempt> created."""
        job_dir = run_dir / f"{index:04d}-{attempt}"
        job_dir.mkdir(parents=True, exist_ok=True)
        return cls(label, index, attempt, spec.retries.max_retries + 1, job_dir, oom.oom_kills())

    @property
    def attempts(self) -> str:
        return f"attempt {self.attempt} of {self.allowed}"

    @property
    def where(self) -> str:
        return f"Logs: {self.job_dir}"

    def write_meta(self, meta: dict[str, Any]) -> None:
        """meta.json in the attempt's folder: how it ran and ended (best effort: the logs may be gone)."""
        with contextlib.suppress(OSError):
            (self.job_dir / "meta.json").write_text(json.dumps(meta, indent=1))


def _on(node: str | None) -> str:
    return "" if node is None else f" on {node}"


def timed_out(run: JobAttempt, timeout: float | None, pid: int, node: str | None = None) -> JobTimeout:
    """The error for an attempt whose process group (pid, on `node` if not this machine) was killed
    after `timeout` seconds."""
    return JobTimeout(
        f"{run.label} exceeded timeout={timeout:g}s ({run.attempts}); its process group {pid}{_on(node)} "
        f"was killed and its cards freed. Raise timeout= if it needs longer. {run.where}"
    )


def result(
    run: JobAttempt,
    pid: int,
    exitcode: int | None,
    signum: int | None,
    tail: OutputTail,
    node: str | None = None,
    oom_counts: tuple[int | None, int | None] | None = None,
) -> Any:
    """The value of a finished attempt from its outcome file; raises the job's exception with a note
    saying where it ran, or JobCrashed (how it ended, the output's tail) if it wrote no outcome.
    `oom_counts` are the OOM-kill counts (before, after) of the cgroup the job ran in when that is
    not this process's (a Ray node); by default the attempt's start count and this cgroup's now."""
    outcome = runner.read_outcome(run.job_dir, run.label)
    if outcome is None:
        before, after = oom_counts if oom_counts is not None else (run.oom_before, oom.oom_kills())
        how = f"exited with code {exitcode}"
        if signum is not None:
            how = f"was {oom.killed_by(signum, before, after)}"
        raise JobCrashed(
            f"{run.label} (pid {pid}{_on(node)}) {how} before returning; {run.attempts}. "
            f"Last output:\n{tail.last_output}\n{run.where}",
            RankFailure(rank=run.index, pid=pid, exitcode=exitcode, signal=signum, output_tail=tail.text),
        )
    ok, value = outcome
    if ok:
        return value
    runner.add_note(value, f"levers9: {run.label} ran as pid {pid}{_on(node)} ({run.attempts}). {run.where}")
    raise value
