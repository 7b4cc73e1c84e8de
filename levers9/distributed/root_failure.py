"""The one builder from how a rank ended (an Outcome) to what `distributed.run` raises, on one node or across nodes."""

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
               where: str = "") -> NoReturn:  # fmt: skip
    """Raise the root cause `failure` (rank, how it ended, its traceback) of a run of `world` ranks: RankCrashed for a
    death or a sys.exit(N), the rank's own exception type otherwise. `where` (" on node 1 (10.0.0.2)") follows its
    pid, `others` ("; rank 1 also failed (below)") its headline, and each of `also` is reported below it."""
    report, pid = root.failure, f"(pid {failure.pid})"
    full = failure.describe() + "".join(f"\n\nAlso failed, after the root cause:\n{f.describe()}" for f in also)
    head = full.splitlines()[0].replace(f"rank {failure.rank} {pid}", f"rank {failure.rank} {pid}{where}", 1)
    if report is not None and report.is_exit:
        headline = f"rank {failure.rank} {pid}{where} called sys.exit({report.message or report.exitcode}){others}."
        raise RankCrashed(f"distributed.run: {headline}\n\n{full}", failure)
    if report is None:
        hint = ""
        if root.signal is not None:  # more than the signal only on evidence: the cgroup's OOM-kill count rose
            how = oom.killed_by(root.signal, *root.oom_counts)
            hint = "" if how == f"killed by {signal_name(root.signal)}" else f"\nrank {failure.rank} was {how}."
        raise RankCrashed(f"distributed.run: {head}{others}.{hint}\n\n{full}", failure)
    raise_rank_exception(f"distributed.run: {head}{others}.\n\n{full}", failure, report,
                         f"levers9: raised on rank {failure.rank} {pid}{where} of {world}{others}. "
                         f"Its traceback:\n{report.traceback.rstrip()}")  # fmt: skip


def rank0_value(outcomes: list[Outcome], raise_root_of: Callable[[list[Outcome]], NoReturn]) -> Any:
    """Rank 0's value when every rank returned; else what `raise_root_of(outcomes)` raises (the root cause)."""
    if any(not o.succeeded for o in outcomes):
        raise_root_of(outcomes)
    return unship_value(outcomes[0].value, "distributed.run: rank 0's return value")


def rank_failed_behind(exc: BaseException) -> RankFailed | None:
    """The RankFailed behind `exc`: `exc` itself, or the cause of a rank's own exception raised from one; else None
    (a bad argument, something before any rank ran fn)."""
    for error in (exc, exc.__cause__):
        if isinstance(error, RankFailed):
            return error
    return None
