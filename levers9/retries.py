"""One retry policy for both layers: how many more attempts a failure gets, on which kinds, how long between.

`distributed.run(max_restarts=, restart_on=, restart_delay=)` and `@job(retries=...)` both become a
`RetryPolicy`, and both loops run through `run_with_retries`. Each keeps its public words, and a word
names a set of `FailureKind`s (levers9.errors); the two tables differ in one place, kept from before
they were one type: a process that left with an exit code of its own (`EXIT`) is an "exception" to
restart_on= (the rank's code chose to leave) and a "crash" to retries= (the job died before returning),
and a lost Ray task is a "comm" failure to restart_on= (a node of the run went away) and a "crash" to
retries=.

restart_on= (ranks of distributed.run):
    crash      a rank was killed by a signal (the out-of-memory killer included) or its card failed
    comm       a collective or the rendezvous failed: a lost peer, a closed socket, a gloo/NCCL error, a lost node
    stall      no rank made collective progress for stall_timeout seconds
    timeout    an attempt outlived timeout= (each attempt has the whole timeout)
    exception  fn raised, or a rank left with a non-zero exit code of its own accord
retries= (job processes):
    crash      the job process died before returning: a signal, os._exit(N), sys.exit(N), its Ray task lost
    timeout    it outlived timeout=
    exception  the function raised
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from levers9.errors import ConfigError, FailureKind, JobConfigError

T = TypeVar("T")
K = FailureKind

RESTART_WORDS: Mapping[str, frozenset[FailureKind]] = {
    "crash": frozenset({K.CRASH}),
    "comm": frozenset({K.COMM, K.LOST}),
    "stall": frozenset({K.STALL}),
    "timeout": frozenset({K.TIMEOUT}),
    "exception": frozenset({K.EXCEPTION, K.EXIT}),
}
RETRY_WORDS: Mapping[str, frozenset[FailureKind]] = {
    "crash": frozenset({K.CRASH, K.EXIT, K.LOST}),
    "timeout": frozenset({K.TIMEOUT}),
    "exception": frozenset({K.EXCEPTION, K.COMM, K.STALL}),
}
DEFAULT_RESTART_ON = ("crash", "comm", "stall")
DEFAULT_RETRY_ON = ("crash", "timeout")
DEFAULT_RESTART_DELAY_S = 1.0


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How often a failed attempt is run again, on which kinds of failure, and how long to wait before each."""

    max_retries: int = 0
    on: tuple[str, ...] = ()  # the public words the kinds came from, as the user gave them
    kinds: frozenset[FailureKind] = frozenset()
    initial_delay: float = DEFAULT_RESTART_DELAY_S
    backoff_coefficient: float = 1.0
    max_delay: float = math.inf

    def retries(self, kind: FailureKind | None) -> bool:
        """True if a failure of this kind is one this policy runs again."""
        return kind is not None and kind in self.kinds

    def word_for(self, kind: FailureKind, table: Mapping[str, frozenset[FailureKind]]) -> str:
        """The public word of `table` that names `kind` ('exception' for EXIT under restart_on=)."""
        return next((word for word, kinds in table.items() if kind in kinds), kind.value)

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt number `attempt` (2 is the first retry)."""
        return min(self.max_delay, self.initial_delay * self.backoff_coefficient ** max(0, attempt - 2))


def Retries(  # noqa: N802 - the public name @job(retries=Retries(...)) has always had
    max_retries: int,
    backoff_coefficient: float = 2.0,
    initial_delay: float = 1.0,
    max_delay: float = 60.0,
    on: tuple[str, ...] = DEFAULT_RETRY_ON,
) -> RetryPolicy:
    """@job's retry policy: how often a failed job is run again, and how long to wait between attempts.

    Args:
        max_retries: Re-runs after the first attempt, 0 to 10.
        backoff_coefficient: Each wait is this many times the one before (1.0 to 10.0).
        initial_delay: Seconds before the first retry (0 to 60).
        max_delay: The longest wait, in seconds (0 to 60).
        on: What counts: "crash" (the process died: a signal, os._exit, sys.exit(N), an out-of-memory
            kill), "timeout" (it outlived timeout=) and "exception" (the function raised). The default
            retries crashes and timeouts only: an exception is usually a bug that would repeat.

    Raises:
        JobConfigError: A value out of its range, or a word `on` does not know.
    """
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or not 0 <= max_retries <= 10:
        raise JobConfigError(f"Retries(max_retries={max_retries!r}): expected an int from 0 to 10.")
    if not 1.0 <= backoff_coefficient <= 10.0:
        raise JobConfigError(f"Retries(backoff_coefficient={backoff_coefficient!r}): expected 1.0 to 10.0.")
    if not 0.0 <= initial_delay <= 60.0:
        raise JobConfigError(f"Retries(initial_delay={initial_delay!r}): expected 0 to 60 seconds.")
    if not 0.0 <= max_delay <= 60.0:
        raise JobConfigError(f"Retries(max_delay={max_delay!r}): expected 0 to 60 seconds.")
    if isinstance(on, str) or any(word not in RETRY_WORDS for word in on):
        raise JobConfigError(f"Retries(on={on!r}): expected a tuple of 'crash', 'timeout' and 'exception'.")
    return RetryPolicy(max_retries, tuple(on), kinds_of(tuple(on), RETRY_WORDS), float(initial_delay),
                       float(backoff_coefficient), float(max_delay))  # fmt: skip


def kinds_of(words: tuple[str, ...], table: Mapping[str, frozenset[FailureKind]]) -> frozenset[FailureKind]:
    """The kinds the public `words` name in `table` (the words are checked by the caller)."""
    return frozenset().union(*(table[word] for word in words))


def restart_policy(max_restarts: object, restart_on: object, restart_delay: object) -> RetryPolicy:
    """distributed.run's max_restarts= / restart_on= / restart_delay= (None: the default) as a policy;
    ConfigError on a bad one."""
    if max_restarts is not None and (isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0):
        raise ConfigError(
            f"max_restarts={max_restarts!r}; expected a whole number >= 0 (how often every rank may be started "
            f"again after a failure). Pass e.g. max_restarts=3, or 0 for none."
        )
    words = DEFAULT_RESTART_ON if restart_on is None else _check_words(restart_on)
    if restart_delay is not None and (
        isinstance(restart_delay, bool) or not isinstance(restart_delay, (int, float)) or not math.isfinite(restart_delay)
        or restart_delay < 0
    ):  # fmt: skip
        raise ConfigError(
            f"restart_delay={restart_delay!r}; expected a number of seconds >= 0 to wait between attempts. "
            f"Pass e.g. restart_delay=5, or leave it unset for {DEFAULT_RESTART_DELAY_S:g} s."
        )
    return RetryPolicy(
        max_retries=0 if max_restarts is None else max_restarts,
        on=words,
        kinds=kinds_of(words, RESTART_WORDS),
        initial_delay=DEFAULT_RESTART_DELAY_S if restart_delay is None else float(restart_delay),
    )


def _check_words(restart_on: object) -> tuple[str, ...]:
    known = tuple(RESTART_WORDS)
    if isinstance(restart_on, str):
        raise ConfigError(
            f"restart_on={restart_on!r} is one string; expected a tuple of kinds of failure, e.g. "
            f"restart_on=({restart_on!r},) or restart_on={DEFAULT_RESTART_ON + (restart_on,)!r}."
        )
    if not isinstance(restart_on, Iterable):
        raise ConfigError(f"restart_on={restart_on!r}; expected a tuple drawn from {known!r}.")
    words = tuple(restart_on)
    for word in words:
        if word not in known:
            hint = " An out-of-memory kill is a 'crash'." if isinstance(word, str) and "oom" in word.lower() else ""
            raise ConfigError(
                f"restart_on={restart_on!r} names {word!r}, which is not a kind of failure levers9 tells apart; "
                f"expected a tuple drawn from {known!r}.{hint} Default: {DEFAULT_RESTART_ON!r}."
            )
    return words


def run_with_retries(
    policy: RetryPolicy,
    attempt: Callable[[int], T],
    *,
    kind_of_error: Callable[[BaseException], FailureKind | None],
    before_retry: Callable[[int, BaseException, FailureKind], bool],
    wait: Callable[[float], None],
) -> T:
    """attempt(1), attempt(2), ... until one returns, or fails in a way the policy does not run again (that
    error is raised as it is). After a failure the policy retries: `before_retry(number, error, kind)` (it
    logs; False stops here and raises the error), then `wait(seconds)` before the next attempt."""
    number = 1
    while True:
        try:
            return attempt(number)
        except BaseException as exc:
            kind = kind_of_error(exc)
            if kind is None or not policy.retries(kind) or number > policy.max_retries:
                raise
            if not before_retry(number, exc, kind):
                raise
        wait(policy.delay(number + 1))
        number += 1
