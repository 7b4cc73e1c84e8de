"""A cell's attempts as the caller sees them; the same for every backend.

`JobAttempt.begin` makes one folder per attempt in the batch's run folder (run_folder.py makes that).
`attempt_cell` resolves a cell's Future through the one retry loop (levers9.retries), retrying the
kinds of failure retries= names. A backend supervises the job process (levers9.procs.supervise),
locally or inside a Ray task, and hands its Outcome to `finish`, which records the attempt's
meta.json and turns the outcome into the return value or the exception the caller sees (JobTimeout,
JobCrashed with the output's tail, or the job's own exception with a note saying where it ran), with
the same words and the same files whichever backend ran it.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Any

from levers9.errors import FailureKind, JobCrashed, JobFailure, JobTimeout, RemoteError, add_note
from levers9.launch.backend import Batch
from levers9.launch.cells import Cell
from levers9.procs import oom
from levers9.procs.failure import FailureRecord, rebuild, unship_value
from levers9.procs.outcome import Outcome, StopReason, kind_of
from levers9.procs.watch import TAIL_LINE_CHARS, cut_line
from levers9.retries import run_with_retries, word_for
from levers9.state_files import AppendLog, Losses, write_atomic

TAIL_LINES = 40  # lines of a job's output kept for the message when it crashes


class Cancelled(Exception):
    """The batch (or the cell's Future) was cancelled while this cell waited or ran."""


def failure_kind(exc: BaseException) -> FailureKind | None:
    """The kind of failure retries= sees in a failed attempt: the one levers9's job errors carry (decided from
    the job process's Outcome), EXCEPTION for anything else the attempt raised; None for a cancel."""
    if isinstance(exc, Cancelled):
        return None
    if isinstance(exc, (JobTimeout, JobCrashed)):
        return exc.kind
    return FailureKind.EXCEPTION


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
    policy = batch.spec.retries

    def retry(number: int, exc: BaseException, kind: FailureKind) -> bool:
        if batch.cancel.cancelled or future.cancelled():
            return False
        word = word_for(kind)
        log.info("%s: %s; retrying (attempt %d of %d)", label, word, number + 1, policy.max_retries + 1)
        batch.events.retrying(cell, number + 1, word)
        return True

    def wait(seconds: float) -> None:
        if not batch.cancel.wait(seconds):
            before_retry()  # the next attempt notices a cancel

    try:
        try:
            value = run_with_retries(policy, attempt, kind_of_error=failure_kind, before_retry=retry, wait=wait)
        except Cancelled:
            if not future.cancel() and not future.done():
                future.set_exception(CancelledError(f"{label} was cancelled"))
            return
        except BaseException as exc:
            batch.events.finished(cell, False, exc)
            _settle(future, exc)
            return
        batch.events.finished(cell, True)
        future.set_result(value)
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
        self._open = False  # the last line kept is a long one's first pieces

    def add(self, text: str, *, piece: bool = False) -> None:
        """Keep a line (its "\\n" optional), or a `piece` of a long one (the line goes on in the next), cut as
        failure reports keep lines (a 100 MB line is never held here)."""
        body = text.removesuffix("\n")
        if self._open and self._lines:
            body = self._lines.pop().removesuffix("\n") + body[:TAIL_LINE_CHARS]
        self._lines.append(cut_line(body) + "\n")
        self._open = piece

    @property
    def text(self) -> str:
        return "".join(self._lines)

    @property
    def last_output(self) -> str:
        """The tail for a message: without trailing blank space, or '(no output)'."""
        return self.text.rstrip() or "(no output)"


class JobAttempt:
    """One attempt of one cell, for every backend: its folder (<run folder>/<index>-<attempt>, with stdout.log,
    stderr.log and meta.json), the tail of its output, its output passed on as events, and the names its messages
    use. A backend starts the cell where it runs, hands each piece of output it reads to `output`, and ends the
    attempt through `finish` (or one of the builders below); `close` (or the with block) closes the logs."""

    def __init__(self, label: str, index: int, attempt: int, allowed: int, job_dir: Path, losses: Losses,
                 output_to: Callable[[str, str], None] | None = None) -> None:  # fmt: skip
        self.label, self.index, self.attempt, self.allowed = label, index, attempt, allowed
        self.job_dir, self.losses = job_dir, losses  # losses: the run folder's (what could not be written there)
        self.tail = OutputTail()
        self._output_to = output_to
        # each log opened at its first output, so attempts that wait (a 10,000-cell SLURM array) hold no descriptor
        self._logs: dict[str, AppendLog] = {}

    @classmethod
    def begin(cls, batch: Batch, label: str, cell: Cell, attempt: int) -> JobAttempt:
        """The attempt, with its log folder created (0700) if the run folder exists and the disk has room; what
        cannot be written there is counted as lost, never raised."""
        folder = batch.folder
        job_dir = folder.path / f"{cell.index:04d}-{attempt}"
        try:
            job_dir.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            folder.losses.lost("attempt log folder", exc)
        return cls(label, cell.index, attempt, batch.spec.retries.max_retries + 1, job_dir, folder.losses,
                   lambda stream, text: batch.events.output(cell, stream, text))  # fmt: skip

    def output(self, stream: str, text: str) -> None:
        """What the job wrote on `stream`: a whole line with its "\n", or a piece of a long one (without): into its
        log (a full disk drops it, never the cell), its tail, and the batch's events."""
        if stream not in self._logs:
            self._logs[stream] = AppendLog(self.job_dir / f"{stream}.log", self.losses)
        self._logs[stream].write(text.encode(errors="surrogateescape"))
        self.tail.add(text, piece=not text.endswith("\n"))
        if self._output_to is not None:
            self._output_to(stream, text)

    def close(self) -> None:
        """Close the logs; a stream the job wrote nothing to gets its empty log, so every attempt has both."""
        for stream in ("stdout", "stderr"):
            append_log = self._logs.pop(stream, None) or AppendLog(self.job_dir / f"{stream}.log", self.losses)
            append_log.close()

    def __enter__(self) -> JobAttempt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def attempts(self) -> str:
        return f"attempt {self.attempt} of {self.allowed}"

    @property
    def where(self) -> str:
        return f"Logs: {self.job_dir}"

    def write_meta(self, meta: dict[str, Any]) -> None:
        """meta.json in the attempt's folder: how it ran and ended (whole or not at all; never raises)."""
        try:
            write_atomic(self.job_dir / "meta.json", json.dumps(meta, indent=1).encode())
        except FileNotFoundError:
            pass  # no folder: the run is unrecorded, or was cleaned while it ran
        except OSError as exc:
            self.losses.lost("meta.json file", exc)


def _on(node: str | None) -> str:
    return "" if node is None else f" on {node}"


def timed_out(run: JobAttempt, timeout: float | None, stopped: str) -> JobTimeout:
    """The error for an attempt stopped after `timeout` seconds; `stopped` says what was stopped and how ('its
    process group 12 was killed', 'SLURM job 5 on l9node1 was cancelled')."""
    return JobTimeout(
        f"{run.label} exceeded timeout={timeout:g}s ({run.attempts}); {stopped} and its cards freed. Raise timeout= if "
        f"it needs longer. {run.where}"
    )


def queue_timed_out(label: str, queue_timeout: float | None, waited_for: str, now: str) -> JobTimeout:
    """The error for a cell that waited `queue_timeout` s for `waited_for` without starting (kind "queue": no
    retry or restart cures it); `now` says what the backend sees free or pending now."""
    assert queue_timeout is not None  # only a spec with a queue_timeout waits out
    return JobTimeout(
        f"{label} waited {queue_timeout:g} s (queue_timeout) for {waited_for}; {now}. Raise queue_timeout=, or "
        f"leave it None to wait.",
        kind="queue",
    )


def ended_without_outcome(run: JobAttempt, where: str, how: str, kind: FailureKind, *,
                          pid: int = 0, oom_killed: bool = False, hint: str = "") -> JobCrashed | JobTimeout:  # fmt: skip
    """The error for an attempt that ended with no outcome of its own reported (its task, job or node lost, a
    cancel or limit from outside): `where` names it ('(SLURM job 5 on l9node1)'), `how` says how it ended."""
    message = (f"{run.label}{where} {how} before returning; {run.attempts}.{hint} Last output:\n{run.tail.last_output}\n"
               f"{run.where}")  # fmt: skip
    if kind is FailureKind.TIMEOUT:
        return JobTimeout(message)
    failure = JobFailure(cell=run.index, pid=pid, output_tail=run.tail.text, kind=kind, oom_killed=oom_killed)
    return JobCrashed(message, failure, kind=kind)


def finish(run: JobAttempt, outcome: Outcome, timeout: float | None, meta: dict[str, Any], node: str | None = None) -> Any:
    """What a supervised attempt comes to, the same for every backend: its meta.json written (how it ran
    and ended; `meta` adds the backend's own facts), then its value, or Cancelled, JobTimeout, JobCrashed
    or the job's own exception raised."""
    stopped = outcome.stopped_for
    run.write_meta({**meta, "pid": outcome.pid, "attempt": run.attempt, "exit_code": outcome.exitcode,
                    "signal": outcome.signal, "killed_for": None if stopped is None else stopped.value})  # fmt: skip
    if stopped is StopReason.CANCEL:
        raise Cancelled()
    if stopped is StopReason.TIMEOUT:
        raise timed_out(run, timeout, f"its process group {outcome.pid}{_on(node)} was killed")
    return result(run, outcome, node)


def result(run: JobAttempt, outcome: Outcome, node: str | None = None) -> Any:
    """The value of a finished attempt; raises the job's exception with a note saying where it ran, or
    JobCrashed (how it ended, the output's tail) if it reported no outcome or called sys.exit(N)."""
    pid, exitcode, signum, failure = outcome.pid, outcome.exitcode, outcome.signal, outcome.failure
    if not outcome.reported or (failure is not None and failure.is_exit):
        if failure is not None:
            exitcode = failure.exitcode
        how = f"was {oom.killed_by(signum, *outcome.oom_counts)}" if signum is not None else f"exited with code {exitcode}"
        raise JobCrashed(
            f"{run.label} (pid {pid}{_on(node)}) {how} before returning; {run.attempts}. "
            f"Last output:\n{run.tail.last_output}\n{run.where}",
            JobFailure(cell=run.index, pid=pid, exitcode=exitcode, signal=signum, output_tail=run.tail.text,
                        oom_killed=outcome.oom_killed, kind=kind_of(outcome)),
            kind=kind_of(outcome) or FailureKind.EXIT,
        )
    if failure is None:
        return unship_value(outcome.value, f"the return value of {run.label}")
    raise raised(failure, f"levers9: traceback of {run.label}, from its job process:\n{failure.traceback.rstrip()}",
                 f"levers9: {run.label} ran as pid {pid}{_on(node)} ({run.attempts}). {run.where}")


def raised(failure: FailureRecord, *notes: str) -> BaseException:
    """The job's own exception, rebuilt from its record (a RemoteError where its type cannot be), with `notes`."""
    exc = rebuild(failure) or RemoteError(failure.exc_type, failure.message, failure.traceback)
    for note in notes:
        add_note(exc, note)
    return exc


def collected_still_running(where: str, timeout: float) -> JobTimeout:
    """The error for a detached job still running after `timeout` s of waiting for it (`levers9 runs result`)."""
    return JobTimeout(f"{where} still runs after {timeout:g} s. Wait longer (--timeout), or see its output with "
                      f"`levers9 runs logs`.")  # fmt: skip


def collected_without_result(where: str, index: int, output: str) -> JobCrashed:
    """The error for a detached job that ended without a result of its own (killed, cancelled, out of time)."""
    return JobCrashed(f"{where} ended without a result (killed, cancelled, or out of time). Its output: {output}.",
                      JobFailure(cell=index, pid=0, output_tail=""))  # fmt: skip
