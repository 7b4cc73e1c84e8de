"""Parent side: the one supervisor. Started children watched until they are all over, then one Outcome each.

`distributed.run` supervises its ranks with one, the local executor a job process, a Ray task the
job process it started on its node, the SLURM backend the tasks of a job (with no Watcher: they are not
this machine's children, and `before_stop` stops them). The supervisor pumps the children's output and messages
(watch.Watcher), and stops them all (SIGTERM to each child's process group, `grace` seconds, then
SIGKILL) when the deadline passes, `should_stop()` or `stalled()` turns true, or, for ranks
(`stop_on_failure`), once one of them failed: after a short window in which an earlier failure
still on its way through a pipe can arrive, so the root cause is the first in time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from levers9.procs import oom
from levers9.procs.failure import FailureRecord
from levers9.procs.outcome import Outcome, StopReason
from levers9.procs.watch import Watcher

ROOT_CAUSE_WINDOW_S = 0.15  # after the first failure, wait this long for an earlier one still in flight
DRAIN_S = 0.5  # after the children ended or were stopped, read what is left in their pipes for at most this long


class Watched(Protocol):
    """What the supervisor watches: a Child on its Watcher, or something that ends the same way (another node's
    share of ranks, levers9.distributed.nodes), polled each step."""

    pid: int
    result: bytes | None
    failure: FailureRecord | None
    reported: bool
    oom_before: int | None
    ended_at: float | None
    lost: bool  # nothing is known of how it ended

    def poll(self) -> bool: ...

    @property
    def failed(self) -> bool: ...

    @property
    def exitcode(self) -> int | None: ...

    @property
    def signal(self) -> int | None: ...


class Supervisor:
    """Children on one Watcher, watched until every one has ended (by itself, or stopped for `stopped_for`).

    Step it (`step`) where the caller has work of its own between pumps (a Ray task sends output back),
    or `run` it to the end; `outcomes()` then says how each child ended, in the order given.
    `before_stop(reason)` runs while the children still live, just before they are stopped. With
    `stop_on_failure`, the others are stopped `window` s after the first failure of its own was seen, or
    `peer_loss_window` s (default `window`) after the first failure of any kind (one that only says a peer was lost
    may wait for the peer's own report).
    """

    def __init__(
        self,
        watcher: Watcher | None,
        children: Sequence[Watched],
        *,
        timeout: float | None,
        grace: float,
        stop_on_failure: bool = False,
        should_stop: Callable[[], bool] = lambda: False,
        stalled: Callable[[float], bool] | None = None,
        before_stop: Callable[[StopReason], None] | None = None,
        window: float = ROOT_CAUSE_WINDOW_S,
        peer_loss_window: float | None = None,
    ) -> None:
        self.watcher, self.children, self.grace = watcher, list(children), grace
        self.stop_on_failure, self.should_stop, self.stalled, self.before_stop = stop_on_failure, should_stop, stalled, before_stop
        self.window, self.peer_loss_window = window, window if peer_loss_window is None else peer_loss_window
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout
        self.stopped_for: StopReason | None = None
        self.over = False
        self._stopped: list[Watched] = []  # children still running when they were stopped
        self._failure_seen_at: float | None = None
        self._own_failure_seen_at: float | None = None  # a failure that is not only a lost peer

    def step(self, wait: float) -> bool:
        """Pump for up to `wait` s (never past the deadline), then stop the children if a rule says so;
        True once every child has ended."""
        if self.over:
            return True
        if self.deadline is not None:
            wait = max(0.0, min(wait, self.deadline - time.monotonic()))
        if self.watcher is not None:
            self.watcher.pump(wait)
        now = time.monotonic()
        if all([child.poll() for child in self.children]):  # every one polled: another node's share reads its news there
            if self.watcher is not None:
                self.watcher.drain(DRAIN_S)
                self.watcher.stop(0)  # whatever they left behind in their groups
            self.over = True
            return True
        if self.stop_on_failure and self._first_failures(now):
            return self._stop(StopReason.SIBLING)
        if self.should_stop():
            return self._stop(StopReason.CANCEL)
        if self.deadline is not None and now >= self.deadline:
            return self._stop(StopReason.TIMEOUT)
        if self.stalled is not None and self.stalled(now):
            return self._stop(StopReason.STALL)
        return False

    def _first_failures(self, now: float) -> bool:
        """Note when the first failure, and the first of its own, were seen; True once a window after them passed."""
        if self._own_failure_seen_at is None:
            failed = [child.failure for child in self.children if child.failed]
            if failed and self._failure_seen_at is None:
                self._failure_seen_at = now
            if any(failure is None or not failure.peer_loss for failure in failed):
                self._own_failure_seen_at = now
        own, first = self._own_failure_seen_at, self._failure_seen_at
        return (own is not None and now - own >= self.window) or (first is not None and now - first >= self.peer_loss_window)

    def idle(self, wait: float) -> None:
        """Pump for `wait` s and apply no rule (the caller waits for an answer of its own meanwhile)."""
        if self.watcher is not None:
            self.watcher.pump(wait)

    def run(self, every: float = 0.05) -> list[Outcome]:
        """Step until every child has ended; how each ended."""
        while not self.step(every):
            pass
        return self.outcomes()

    def _stop(self, reason: StopReason) -> bool:
        self.stopped_for = reason
        # a child that reported its failure first is not stopped for another's: it failed by itself, and only its
        # exit (threads, atexit handlers) is cut short
        self._stopped = [child for child in self.children if not child.poll() and child.failure is None]
        if self.before_stop is not None:
            self.before_stop(reason)
        if self.watcher is not None:
            self.watcher.stop(self.grace)
            self.watcher.drain(DRAIN_S)
        self.over = True
        return True

    def outcomes(self) -> list[Outcome]:
        """How each child ended, in the order given (call once they are over)."""
        after = oom.oom_kills() if any(child.signal is not None for child in self.children) else None
        return [self.outcome_of(child, after) for child in self.children]

    def outcome_of(self, child: Watched, oom_after: int | None = None) -> Outcome:
        """How `child` ended; `oom_after` is the cgroup's OOM-kill count now (read here when not given)."""
        if child.signal is not None and oom_after is None:
            oom_after = oom.oom_kills()
        return Outcome(
            pid=child.pid,
            exitcode=child.exitcode,
            signal=child.signal,
            value=child.result,
            failure=child.failure,
            reported=child.reported,
            stopped_for=self.stopped_for if any(child is c for c in self._stopped) else None,
            oom_counts=(child.oom_before, oom_after),
            lost=child.lost,
            ended=child.ended_at,
        )
