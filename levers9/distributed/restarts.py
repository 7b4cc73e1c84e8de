"""Restarts of a run whose ranks levers9 started: the attempts so far, the warning between them, the final error.

Each attempt is a fresh set of ranks with a fresh rendezvous store, forked from the caller again (no second
`import torch`). After a failure `restart_on` names (levers9.retries), with every rank stopped, one warning line is
logged, `restart_delay` seconds pass (Ctrl-C there ends the run, nothing running) and the next attempt starts with
TORCHELASTIC_RESTART_COUNT one higher; fn runs from the top (resuming from a checkpoint is the user's code's job).
The default restarts crash, comm and stall failures: they come from the machine, the network or another rank, and
often do not repeat. An exception from the user's code (a KeyError at step 0) repeats on every attempt, and a
timeout usually means the run is longer than the limit, not that it failed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

from levers9.errors import (
    FailureKind,
    NodeLost,
    RankCrashed,
    RankFailed,
    RankFailure,
    RunTimeout,
    StallError,
    add_note,
    first_line,
    signal_name,
)
from levers9.procs import oom, watch
from levers9.procs.failure import raise_rank_exception, unship_value
from levers9.procs.outcome import Outcome, kind_of
from levers9.procs.watch import output_excerpt
from levers9.retries import RetryPolicy, run_with_retries, word_for, words_adding

LAST_ATTEMPT = "\n\nThe last attempt's error in full:\n"  # after restarts, where the last attempt's report begins
FIRST_LINE_CHARS = 160  # of a failure's message, in the one-line account of an attempt

log = logging.getLogger("levers9.distributed")
T = TypeVar("T")


def attempt_env(restart_count: int, max_restarts: int) -> dict[str, str]:
    """The variables each rank of an attempt gets, as torchrun names them."""
    return {"TORCHELASTIC_RESTART_COUNT": str(restart_count), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}


@dataclasses.dataclass(frozen=True)
class FailedAttempt:
    """One failed attempt of a run: its restart count, its kind of failure (None: not a rank's), its cause, how long it ran."""

    number: int
    kind: FailureKind | None
    cause: str
    seconds: float

    def line(self) -> str:
        kind = f" [{word(self.kind)}]" if self.kind else ""
        return f"attempt {self.number + 1} (ran {self.seconds:.1f} s): {self.cause}{kind}"


word = word_for  # restart_on='s word for a FailureKind


def run_attempts(
    policy: RetryPolicy,
    start: Callable[[dict[str, str]], T],
    *,
    ranks: int,
    timeout: float | None,
    stall_timeout: float | None,
    caller: str = "distributed.run",
) -> T:
    """`start(env)` (one attempt with the extra rank variables `env`: rank 0's value, or its root failure raised
    with every rank stopped) until an attempt returns; a failure the policy restarts is logged, waited out and
    retried. The final failure lists every attempt's root cause, oldest first; `caller` names the caller."""
    history: list[FailedAttempt] = []
    began = [time.monotonic()]

    def attempt(number: int) -> T:
        began[0] = time.monotonic()
        return start(attempt_env(number - 1, policy.max_retries))

    def record(exc: BaseException) -> FailedAttempt:
        kind = kind_of_error(exc)
        history.append(FailedAttempt(len(history), kind, cause_of(exc, timeout, stall_timeout), time.monotonic() - began[0]))
        return history[-1]

    def before_retry(number: int, exc: BaseException, kind: FailureKind) -> bool:
        failed = record(exc)
        log.warning(
            "%s: attempt %d of %d failed after %.1f s (work since its last checkpoint is lost): "
            "%s [%s]; every rank was stopped; starting all %d ranks again in %g s (restart %d of %d)",
            caller, number, policy.max_retries + 1, failed.seconds, failed.cause, word(kind), ranks, policy.delay(number + 1),
            number, policy.max_retries,
        )  # fmt: skip
        return True

    try:  # between attempts no rank runs: Ctrl-C in the wait (whichever thread got it) ends the run, nothing left
        return run_with_retries(policy, attempt, kind_of_error=kind_of_error, before_retry=before_retry, wait=watch.sleep)
    except Exception as exc:
        record(exc)
        final = final_error(exc, history, policy, caller)
        if final is exc:
            raise
        raise final from None


def kind_of_error(exc: BaseException) -> FailureKind | None:
    """The kind of failure an attempt's error carries (a rank's own exception: its RankFailed cause's); None
    when it is not a rank's failure (a bad argument, something before any rank ran fn)."""
    failed = rank_failed_behind(exc)
    return None if failed is None else failed.kind


def cause_of(exc: BaseException, timeout: float | None, stall_timeout: float | None) -> str:
    """An attempt's root cause in a phrase, for the warning and the final history."""
    if isinstance(exc, RunTimeout):
        return f"still running after {timeout:g} s (timeout={timeout:g})" if timeout else "timed out"
    if isinstance(exc, StallError):
        seconds = f" for {stall_timeout:g} s (stall_timeout={stall_timeout:g})" if stall_timeout else ""
        return f"no rank issued or completed a collective{seconds} while one waited"
    if isinstance(exc, NodeLost):
        return f"lost node {exc.node} (ranks {', '.join(map(str, exc.ranks))})"
    wrapper = exc if isinstance(exc, RankFailed) else exc.__cause__
    if not isinstance(wrapper, RankFailed) or wrapper.failure is None:
        return f"{type(exc).__name__}: {first_line(str(exc), FIRST_LINE_CHARS)}"
    return _phrase(wrapper.failure)


def _phrase(failure: RankFailure) -> str:
    phrase = f"rank {failure.rank} (pid {failure.pid}) {failure.how()}"
    if failure.exc_type and failure.message:
        phrase += f": {first_line(failure.message, FIRST_LINE_CHARS)}"
    if failure.oom_killed:
        phrase += " (the out-of-memory killer)"
    return phrase


def final_error(exc: Exception, attempts: list[FailedAttempt], policy: RetryPolicy, caller: str = "distributed.run") -> Exception:
    """The error run raises: `exc` itself after one attempt; after restarts, the same type carrying the history.

    levers9's own errors get the history at the top of their message and the last attempt's full
    report below it; a user's exception, rebuilt with its own type, gets the history as a note.
    """
    last = attempts[-1]
    if len(attempts) == 1:
        if policy.max_retries and last.kind is not None:
            count = _arg(caller, "max_restarts", policy.max_retries)
            add_note(exc, f"levers9: not restarted ({count}): {_why_not(last.kind, policy, caller)}")
        return exc
    history = "\n".join(f"  {attempt.line()}" for attempt in attempts)
    if policy.retries(last.kind):
        headline = (
            f"{caller}: every attempt failed ({len(attempts)} attempts, {_arg(caller, 'max_restarts', policy.max_retries)}); "
            f"restarting all ranks did not cure it, so the cause is probably not transient. Expected an attempt to "
            f"finish; fix the cause of the last failure below, or pass a larger {_arg(caller, 'max_restarts', '')} if "
            f"the failures are rare and unrelated."
        )
    else:
        headline = (
            f"{caller}: attempt {len(attempts)} failed after {len(attempts) - 1} restart(s) and was not "
            f"restarted: {_why_not(last.kind, policy, caller)}"
        )
    text = f"{headline}\nRoot causes, oldest first:\n{history}"
    if isinstance(exc, RankFailed) and type(exc).__init__ is RankFailed.__init__:
        return type(exc)(f"{text}{LAST_ATTEMPT}{exc}", exc.failure)
    add_note(exc, f"levers9: {text}")
    return exc


def _why_not(kind: FailureKind | None, policy: RetryPolicy, caller: str = "distributed.run") -> str:
    if kind is None:
        return "the failure came before any rank ran fn, and a restart cannot cure it."
    if kind is FailureKind.QUEUE:
        return ("no node came to replace a lost one within queue_timeout=, and a restart would wait for one again. "
                "Add a node to the cluster, or pass a larger @job(queue_timeout=).")
    name = word(kind)
    reason = {
        "exception": "an exception raised by the user's code is usually raised again at the same step",
        "exit": "a rank that chose its own exit code usually chooses it again at the same step",
        "timeout": "a run longer than timeout= would time out again",
    }.get(name, "it was left out")
    wider = words_adding(policy.on, kind, "restart_on")
    return (
        f"it was a '{name}' failure and {_arg(caller, 'restart_on', policy.on)} leaves that out ({reason}). "
        f"Pass {_arg(caller, 'restart_on', wider)} to restart on it too."
    )


def _arg(caller: str, keyword: str, value: object) -> str:
    """`keyword` set to `value` as the caller spells it: `restart_on=('crash',)` for distributed.run, `--restart-on crash`
    on levers9 run's command line (an empty `value`: the keyword alone)."""
    if not caller.startswith("levers9 "):
        return f"{keyword}={value!r}" if value != "" else f"{keyword}="
    shown = ",".join(value) if isinstance(value, tuple) else str(value)
    return f"--{keyword.replace('_', '-')} {shown}".rstrip()


# The one builder from how a rank ended (an Outcome) to what `distributed.run` (or `spawn`) raises, on one
# node or across nodes.


def rank_failure(rank: int, outcome: Outcome, tail: Sequence[str]) -> RankFailure:
    """What is known of global `rank`'s failure, from how it ended, what it reported and its last output `tail`."""
    report = outcome.failure
    return RankFailure(
        rank=rank,
        pid=outcome.pid,
        exitcode=outcome.exitcode if report is None else report.exitcode,
        signal=outcome.signal if report is None else None,
        exc_type=None if report is None or report.is_exit else report.exc_type,
        message="" if report is None else report.message,
        traceback="" if report is None else report.traceback,
        output_tail=output_excerpt(list(tail)),
        oom_killed=outcome.oom_killed,
        kind=kind_of(outcome),
    )


def raise_root(failure: RankFailure, root: Outcome, *, world: int, others: str, also: Sequence[RankFailure] = (),
               where: str = "", caller: str = "distributed.run") -> NoReturn:  # fmt: skip
    """Raise the root cause `failure` (rank, how it ended, its traceback) of a run of `world` ranks: RankCrashed for a
    death or a sys.exit(N), the rank's own exception type otherwise (its traceback in a note, a RankFailed naming the
    others as its cause), each failed rank's traceback once. `where` (" on node 1 (10.0.0.2)") follows its pid,
    `others` ("; rank 1 also failed (below)") its headline, and each of `also` is reported below it. `caller`
    "spawn": what mp.spawn raises (spawn_errors.py), in its words."""
    report, pid = root.failure, f"(pid {failure.pid})"
    below = "".join(f"\n\nAlso failed, after the root cause:\n{f.describe()}" for f in also)
    if caller == "spawn":
        _raise_as_mp_spawn(failure, root, others, below)
    full = failure.describe() + below
    head = full.splitlines()[0].replace(f"rank {failure.rank} {pid}", f"rank {failure.rank} {pid}{where}", 1)
    if report is not None and report.is_exit:
        headline = f"rank {failure.rank} {pid}{where} called sys.exit({report.message or report.exitcode}){others}."
        raise RankCrashed(f"{caller}: {headline}\n\n{full}", failure)
    if report is None:
        raise RankCrashed(f"{caller}: {head}{others}.{_signal_hint(failure, root)}\n\n{full}", failure)
    raise_rank_exception(f"{caller}: {head}{others}.\n\n{full}", failure, report,
                         f"levers9: raised on rank {failure.rank} {pid}{where} of {world}{others.replace('(below)', '(above)')}. "
                         f"Its traceback:\n{report.traceback.rstrip()}", beside_note=f"{caller}: {head}{others}.{below}")  # fmt: skip


def _signal_hint(failure: RankFailure, root: Outcome) -> str:
    """More than the signal, only on evidence: "rank 1 was killed by the out-of-memory killer" when the cgroup's
    OOM-kill count rose; else ""."""
    if root.signal is None:
        return ""
    how = oom.killed_by(root.signal, *root.oom_counts)
    return "" if how == f"killed by {signal_name(root.signal)}" else f"\nrank {failure.rank} was {how}."


def _raise_as_mp_spawn(failure: RankFailure, root: Outcome, others: str, below: str) -> NoReturn:
    """Raise what torch.multiprocessing.spawn raises for the root cause, in its words (a process raised: its
    traceback; it exited: its code or signal), with levers9's report of the other processes below."""
    from levers9.distributed.spawn_errors import ProcessExited, ProcessRaised  # loads torch: only under spawn

    rest = (f"\n\nlevers9: {others.removeprefix('; ')}." if others else "") + below
    report = root.failure
    if report is not None and not report.is_exit:
        raise ProcessRaised(f"\n\n-- Process {failure.rank} terminated with the following error:\n"
                            f"{report.traceback.rstrip()}{rest}", failure.rank, failure.pid, failure)  # fmt: skip
    code = failure.exitcode if failure.signal is None else -failure.signal
    name = None if failure.signal is None else signal_name(failure.signal)
    how = f"exit code {code}" if name is None else f"signal {name}"
    tail = f"\n\nLast output of process {failure.rank}:\n{failure.output_tail.rstrip()}" if failure.output_tail else ""
    raise ProcessExited(f"process {failure.rank} terminated with {how}{_signal_hint(failure, root)}{tail}{rest}",
                        failure.rank, failure.pid, code if code is not None else 1, name, failure)  # fmt: skip


def rank0_value(outcomes: list[Outcome], raise_root_of: Callable[[list[Outcome]], NoReturn], caller: str = "distributed.run") -> Any:
    """Rank 0's value when every rank returned; else what `raise_root_of(outcomes)` raises (the root cause)."""
    if any(not o.succeeded for o in outcomes):
        raise_root_of(outcomes)
    return unship_value(outcomes[0].value, f"{caller}: rank 0's return value")


def rank_failed_behind(exc: BaseException) -> RankFailed | None:
    """The RankFailed behind `exc`: `exc` itself, or the cause of a rank's own exception raised from one; else None
    (a bad argument, something before any rank ran fn)."""
    for error in (exc, exc.__cause__):
        if isinstance(error, RankFailed):
            return error
    return None
