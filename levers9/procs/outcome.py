"""How a supervised child ended, as one typed value, and the kind of failure that was (pure: no process here).

Every child levers9 starts (a rank of `distributed.run`, a local job, a job inside a Ray task) is
watched by one Supervisor (supervise.py) and ends as an `Outcome`: its exit code or signal, what it
sent back (a value, or a `FailureRecord` of what it raised), why the supervisor stopped it if it
did, and the cgroup's out-of-memory kill counts around it. `kind_of` names the kind of failure from
those typed fields alone (`levers9.errors.FailureKind`); `restart_on=` and `retries=` choose from them.

The one place where words are read is at the boundary, in the child, while the exception is live
(failure.capture): torch reports a lost peer and CUDA a failed card only as exception text, and
the record carries the answer as the typed fields `peer_loss` and `card_fault`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time

from levers9.errors import FailureKind
from levers9.procs.failure import FailureRecord

# Exception types (as the failure codec names them) raised when a collective or the rendezvous failed.
COMM_TYPES = frozenset(
    ("torch.distributed.DistBackendError", "torch.distributed.DistNetworkError", "torch.distributed.DistStoreError")
)


class StopReason(str, enum.Enum):
    """Why the supervisor stopped a child that was still running."""

    TIMEOUT = "timeout"  # the deadline passed
    STALL = "stall"  # the stall check fired
    CANCEL = "cancel"  # the caller cancelled (a Future, the batch, leaving a map loop early)
    SIBLING = "sibling"  # another child of the same run failed first


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one child ended: its exit status, what it sent back, why it was stopped, OOM-kill counts around it."""

    pid: int
    exitcode: int | None  # None when it died by a signal (or was never reaped: see `lost`)
    signal: int | None
    value: bytes | None = None  # what it returned, shipped (None: nothing, or not asked for)
    failure: FailureRecord | None = None  # what it raised or the sys.exit(N) it called, as the child recorded it
    reported: bool = False  # it sent a "result" or "error" message before it ended
    stopped_for: StopReason | None = None  # None: it ended by itself
    oom_counts: tuple[int | None, int | None] = (None, None)  # its cgroup's OOM-kill count at start and at the end
    lost: bool = False  # nothing is known of how it ended (its node or its watcher is gone)
    ended: float | None = None  # time.monotonic() when the supervisor saw it end (None: not seen)

    @property
    def succeeded(self) -> bool:
        """It exited 0 by itself with no failure reported (a job must also have `reported` its value)."""
        return self.stopped_for is None and not self.lost and self.failure is None and self.exitcode == 0

    @property
    def oom_killed(self) -> bool:
        """Killed by a signal while its cgroup's out-of-memory kill count rose."""
        before, after = self.oom_counts
        return self.signal is not None and before is not None and after is not None and after > before


def consequence(failure: FailureRecord | None) -> int:
    """How likely a child's failure is a consequence of another's, for ordering the root cause first: 0 for a
    failure of its own (an exception, or a death with nothing reported: a signal beats the exits it causes in
    its peers), 1 for sys.exit(N) (more often a script's reaction to a lost peer than a cause), 2 for an
    error that only says a peer was lost."""
    if failure is None:
        return 0
    if failure.peer_loss:
        return 2
    return 1 if failure.is_exit else 0


def root_cause(outcomes: list[Outcome]) -> Outcome:
    """The failed child that failed first by itself: a child stopped because another failed never before one
    that failed by itself, then by `consequence`, then by time (a record's own clock, else when it was seen
    ending; CLOCK_MONOTONIC is one clock for every process of the machine)."""

    def order(outcome: Outcome) -> tuple[int, int, float]:
        when = outcome.failure.when if outcome.failure is not None else outcome.ended
        return (outcome.stopped_for is not None, consequence(outcome.failure), math.inf if when is None else when)

    return min((o for o in outcomes if not o.succeeded), key=order)


def wall_clock(when: float) -> float:
    """A time.monotonic() instant of this machine as wall-clock time: how a failure's time travels to another
    machine, whose monotonic clock is not this one's."""
    return time.time() - (time.monotonic() - when)


def this_clock(wall: float) -> float:
    """Another machine's wall-clock instant (`wall_clock`) on this machine's time.monotonic() clock, so that
    `root_cause` can order it beside this machine's own."""
    return time.monotonic() - (time.time() - wall)


def kind_of(outcome: Outcome) -> FailureKind | None:
    """The kind of failure `outcome` is, from its typed fields only; None when it returned (exit 0 with
    nothing reported is EXIT: it left before returning)."""
    if outcome.succeeded and outcome.reported:
        return None
    if outcome.lost:
        return FailureKind.LOST
    if outcome.stopped_for is StopReason.TIMEOUT:
        return FailureKind.TIMEOUT
    if outcome.stopped_for is StopReason.STALL:
        return FailureKind.STALL
    failure = outcome.failure
    if failure is not None and not failure.is_exit:
        if failure.exc_type in COMM_TYPES or failure.peer_loss:
            return FailureKind.COMM
        return FailureKind.CRASH if failure.card_fault else FailureKind.EXCEPTION
    if outcome.signal is not None:
        return FailureKind.CRASH
    return FailureKind.EXIT
