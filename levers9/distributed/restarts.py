"""Restarts of a spawned run: which failures a restart can cure, the attempts so far, the final error.

`distributed.run(fn, cfg, max_restarts=N)` hands `run_attempts` a function that starts one attempt:
a fresh set of ranks with a fresh rendezvous store, forked from the caller again (no new
interpreter, no second `import torch`). When an attempt fails in a way `restart_on` names, every
rank is already stopped; one warning line is logged, `restart_delay` seconds pass (Ctrl-C there
raises KeyboardInterrupt with nothing running), and the next attempt starts, with
TORCHELASTIC_RESTART_COUNT one higher in every rank. `fn` runs from the top: resuming from a
checkpoint is the user's code's job (`dist.restart_count()` says which attempt this is).

What each kind of failure is, as `restart_on` names it:
    crash      a rank was killed by a signal (the out-of-memory killer included) or its card failed
    comm       a collective or the rendezvous failed: a lost peer, a closed socket, a gloo/NCCL error
    stall      no rank made collective progress for stall_timeout seconds
    timeout    an attempt outlived timeout= (each attempt has the whole timeout)
    exception  fn raised, or a rank left with a non-zero exit code of its own accord
The default restarts the first three: they come from the machine, the network or another rank, and
often do not repeat. An exception from the user's code (a KeyError at step 0) repeats at step 0 on
every attempt, and a timeout usually means the run is longer than the limit, not that it failed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from levers9.errors import ConfigError, NodeLost, RankFailed, RankFailure, RunTimeout, StallError, add_note
from levers9.procs.failure import PEER_LOSS_MARKERS

log = logging.getLogger("levers9.distributed")
T = TypeVar("T")

KINDS = ("crash", "comm", "stall", "timeout", "exception")
DEFAULT_RESTART_ON = ("crash", "comm", "stall")
DEFAULT_RESTART_DELAY_S = 1.0

# Exception types (as the failure codec names them) raised when a collective or the rendezvous failed.
COMM_TYPES = ("torch.distributed.DistBackendError", "torch.distributed.DistNetworkError", "torch.distributed.DistStoreError")
# Messages of errors a faulty card raises (CUDA reports them as RuntimeError): a crash, not the user's bug.
CARD_FAULT_MARKERS = ("uncorrectable ECC error", "GPU has fallen off the bus", "GPU is lost")


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """How many restarts a run may use, on which kinds of failure, and how long to wait before each."""

    max_restarts: int = 0
    restart_on: tuple[str, ...] = DEFAULT_RESTART_ON
    delay: float = DEFAULT_RESTART_DELAY_S

    def restarts(self, kind: str | None) -> bool:
        """True if a failure of this kind is one a restart may cure, by this policy."""
        return kind is not None and kind in self.restart_on


def check_restart_args(max_restarts: Any, restart_on: Any, restart_delay: Any) -> RestartPolicy:
    """The policy for run's arguments (None: the default); ConfigError on a bad one."""
    if max_restarts is not None and (isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0):
        raise ConfigError(
            f"max_restarts={max_restarts!r}; expected a whole number >= 0 (how often every rank may be started "
            f"again after a failure). Pass e.g. max_restarts=3, or 0 for none."
        )
    kinds = DEFAULT_RESTART_ON if restart_on is None else _check_kinds(restart_on)
    if restart_delay is not None and (
        isinstance(restart_delay, bool) or not isinstance(restart_delay, (int, float)) or not math.isfinite(restart_delay)
        or restart_delay < 0
    ):  # fmt: skip
        raise ConfigError(
            f"restart_delay={restart_delay!r}; expected a number of seconds >= 0 to wait between attempts. "
            f"Pass e.g. restart_delay=5, or leave it unset for {DEFAULT_RESTART_DELAY_S:g} s."
        )
    return RestartPolicy(
        max_restarts=0 if max_restarts is None else max_restarts,
        restart_on=kinds,
        delay=DEFAULT_RESTART_DELAY_S if restart_delay is None else float(restart_delay),
    )


def _check_kinds(restart_on: Any) -> tuple[str, ...]:
    if isinstance(restart_on, str):
        raise ConfigError(
            f"restart_on={restart_on!r} is one string; expected a tuple of kinds of failure, e.g. "
            f"restart_on=({restart_on!r},) or restart_on={DEFAULT_RESTART_ON + (restart_on,)!r}."
        )
    if not isinstance(restart_on, Iterable):
        raise ConfigError(f"restart_on={restart_on!r}; expected a tuple drawn from {KINDS!r}.")
    kinds = tuple(restart_on)
    for kind in kinds:
        if kind not in KINDS:
            hint = " An out-of-memory kill is a 'crash'." if isinstance(kind, str) and "oom" in kind.lower() else ""
            raise ConfigError(
                f"restart_on={restart_on!r} names {kind!r}, which is not a kind of failure levers9 tells apart; "
                f"expected a tuple drawn from {KINDS!r}.{hint} Default: {DEFAULT_RESTART_ON!r}."
            )
    return kinds


def attempt_env(restart_count: int, max_restarts: int) -> dict[str, str]:
    """The variables each rank of an attempt gets, as torchrun names them."""
    return {"TORCHELASTIC_RESTART_COUNT": str(restart_count), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One failed attempt: its restart count, the kind of failure (None: not a rank's), its cause, how long it ran."""

    number: int
    kind: str | None
    cause: str
    seconds: float

    def line(self) -> str:
        kind = f" [{self.kind}]" if self.kind else ""
        return f"attempt {self.number + 1} (ran {self.seconds:.1f} s): {self.cause}{kind}"


def run_attempts(
    policy: RestartPolicy,
    start: Callable[[dict[str, str]], T],
    *,
    ranks: int,
    timeout: float | None,
    stall_timeout: float | None,
) -> T:
    """`start(env)` until an attempt returns; a failure the policy restarts is logged, waited out and retried.

    `start` runs one attempt with the extra rank variables `env` and returns rank 0's value or raises
    the attempt's root failure, having stopped every rank. The final failure is raised with every
    attempt's root cause listed, oldest first.
    """
    attempts: list[Attempt] = []
    while True:
        number = len(attempts)
        began = time.monotonic()
        try:
            return start(attempt_env(number, policy.max_restarts))
        except Exception as exc:
            kind, cause = classify(exc, timeout, stall_timeout)
            attempts.append(Attempt(number, kind, cause, time.monotonic() - began))
            if not policy.restarts(kind) or number >= policy.max_restarts:
                final = final_error(exc, attempts, policy)
                if final is exc:
                    raise
                raise final from None
            log.warning(
                "distributed.run: attempt %d of %d failed after %.1f s (work since its last checkpoint is lost): "
                "%s [%s]; every rank was stopped; starting all %d ranks again in %g s (restart %d of %d)",
                number + 1, policy.max_restarts + 1, attempts[-1].seconds, cause, kind, ranks, policy.delay,
                number + 1, policy.max_restarts,
            )  # fmt: skip
        time.sleep(policy.delay)  # no rank runs now: Ctrl-C here ends the run with nothing left behind


def classify(exc: BaseException, timeout: float | None, stall_timeout: float | None) -> tuple[str | None, str]:
    """(kind of failure, its root cause in a phrase) for an attempt's error; kind None: not a rank's failure."""
    if isinstance(exc, RunTimeout):
        return "timeout", f"still running after {timeout:g} s (timeout={timeout:g})" if timeout else "timed out"
    if isinstance(exc, StallError):
        seconds = f" for {stall_timeout:g} s (stall_timeout={stall_timeout:g})" if stall_timeout else ""
        return "stall", f"no rank issued or completed a collective{seconds} while one waited"
    if isinstance(exc, NodeLost):
        return "comm", f"lost node {exc.node} (ranks {', '.join(map(str, exc.ranks))})"
    wrapper = exc if isinstance(exc, RankFailed) else exc.__cause__
    if not isinstance(wrapper, RankFailed) or wrapper.failure is None:
        return None, f"{type(exc).__name__}: {_first_line(str(exc))}"
    failure = wrapper.failure
    return _kind_of(failure), _phrase(failure)


def _kind_of(failure: RankFailure) -> str:
    if failure.signal is not None:
        return "crash"
    if failure.exc_type is None:
        return "exception"  # sys.exit(N) or os._exit(N): the rank's own code chose to leave
    if failure.exc_type in COMM_TYPES or any(marker in failure.message for marker in PEER_LOSS_MARKERS):
        return "comm"
    if any(marker in failure.message for marker in CARD_FAULT_MARKERS):
        return "crash"
    return "exception"


def _phrase(failure: RankFailure) -> str:
    phrase = f"rank {failure.rank} (pid {failure.pid}) {failure.how()}"
    if failure.exc_type and failure.message:
        phrase += f": {_first_line(failure.message)}"
    if failure.oom_killed:
        phrase += " (the out-of-memory killer)"
    return phrase


def _first_line(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def final_error(exc: Exception, attempts: list[Attempt], policy: RestartPolicy) -> Exception:
    """The error run raises: `exc` itself after one attempt; after restarts, the same type carrying the history.

    levers9's own errors get the history at the top of their message and the last attempt's full
    report below it; a user's exception, rebuilt with its own type, gets the history as a note.
    """
    last = attempts[-1]
    if len(attempts) == 1:
        if policy.max_restarts and last.kind is not None:
            add_note(exc, f"levers9: not restarted (max_restarts={policy.max_restarts}): {_why_not(last.kind, policy)}")
        return exc
    history = "\n".join(f"  {attempt.line()}" for attempt in attempts)
    if policy.restarts(last.kind):
        headline = (
            f"distributed.run: every attempt failed ({len(attempts)} attempts, max_restarts={policy.max_restarts}); "
            f"restarting all ranks did not cure it, so the cause is probably not transient. Expected an attempt to "
            f"finish; fix the cause of the last failure below, or pass a larger max_restarts= if the failures are "
            f"rare and unrelated."
        )
    else:
        headline = (
            f"distributed.run: attempt {len(attempts)} failed after {len(attempts) - 1} restart(s) and was not "
            f"restarted: {_why_not(last.kind, policy)}"
        )
    text = f"{headline}\nRoot causes, oldest first:\n{history}"
    if isinstance(exc, RankFailed) and type(exc).__init__ is RankFailed.__init__:
        return type(exc)(f"{text}\n\nThe last attempt's error in full:\n{exc}", exc.failure)
    add_note(exc, f"levers9: {text}")
    return exc


def _why_not(kind: str | None, policy: RestartPolicy) -> str:
    if kind is None:
        return "the failure came before any rank ran fn, and a restart cannot cure it."
    reason = {
        "exception": "an exception raised by the user's code is usually raised again at the same step",
        "timeout": "a run longer than timeout= would time out again",
    }.get(kind, "it was left out")
    return (
        f"it was a '{kind}' failure and restart_on={policy.restart_on!r} leaves that out ({reason}). "
        f"Pass restart_on={policy.restart_on + (kind,)!r} to restart on it too."
    )
