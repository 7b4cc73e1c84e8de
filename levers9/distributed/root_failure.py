"""The one builder from how a rank ended (an Outcome) to what `distributed.run` (or `spawn`) raises, on one node or across nodes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from levers9.errors import RankCrashed, RankFailed, RankFailure, signal_name
from levers9.procs import oom
from levers9.procs.failure import raise_rank_exception, unship_value
from levers9.procs.outcome import Outcome, kind_of
from levers9.procs.watch import output_excerpt


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
