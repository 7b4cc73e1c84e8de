"""One retry policy for both layers: how many more attempts a failure gets, on which kinds, how long between.

`distributed.run(max_restarts=, restart_on=, restart_delay=)` and `@job(retries=...)` both become a
`RetryPolicy`, and both loops run through `run_with_retries`. Both keywords take the same words, one per
`FailureKind` (levers9.errors), each meaning the same kind in both (`WORDS`; the table is in
docs/restarts-and-stalls.md). The words each keyword used before they were one vocabulary keep their old
meaning where it was wider (`LEGACY`: restart_on="comm" also covered a lost node, retries on="crash" also an
exit code of the process's own), with a DeprecationWarning that names the words which say the same today.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from levers9.errors import ConfigError, FailureKind, JobConfigError
from levers9.seconds import is_seconds

T = TypeVar("T")
K = FailureKind

WORDS: Mapping[str, frozenset[FailureKind]] = {
    kind.value: frozenset({kind}) for kind in (K.CRASH, K.EXIT, K.EXCEPTION, K.COMM, K.LOST, K.STALL, K.TIMEOUT)
}
# What a word meant to each keyword before the one vocabulary, where that was wider than WORDS says.
LEGACY: Mapping[str, Mapping[str, frozenset[FailureKind]]] = {
    "restart_on": {"comm": frozenset({K.COMM, K.LOST}), "exception": frozenset({K.EXCEPTION, K.EXIT})},
    "on": {"crash": frozenset({K.CRASH, K.EXIT, K.LOST}), "exception": frozenset({K.EXCEPTION, K.COMM, K.STALL})},
}
DEFAULT_RESTART_ON = ("crash", "comm", "lost", "stall")
# levers9 run's default, torchrun's rule: its agent restarts the workers after any failure it sees (a signal, an exit
# code, an exception) and so does levers9 run; also after a stall levers9 found. Not after --timeout, which would repeat.
TORCHRUN_RESTART_ON = ("crash", "exit", "exception", "comm", "lost", "stall")
DEFAULT_RETRY_ON = ("crash", "exit", "lost", "timeout")
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
        on: What counts, in restart_on='s words: "crash" (killed by a signal, an out-of-memory kill
            included), "exit" (it left with an exit code of its own, os._exit or sys.exit(N)), "lost"
            (its Ray task went away), "timeout" (it outlived timeout=), "exception" (the function
            raised), "comm" and "stall" (a distributed.run inside it failed that way). The default
            retries what killed the process and timeouts: an exception is usually a bug that would repeat.

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
    if isinstance(on, str) or any(word not in WORDS for word in on):
        raise JobConfigError(f"Retries(on={on!r}): expected a tuple drawn from {tuple(WORDS)!r}.")
    words = tuple(on)
    return RetryPolicy(max_retries, words, kinds_of(words, "on"), float(initial_delay),
                       float(backoff_coefficient), float(max_delay))  # fmt: skip


def word_for(kind: FailureKind) -> str:
    """The one public word, in restart_on= and retries= alike, that names `kind`."""
    return kind.value


def kinds_of(words: tuple[str, ...], keyword: str) -> frozenset[FailureKind]:
    """The kinds the public `words` (checked by the caller) name for `keyword` ("restart_on" or "on"), a word's
    wider LEGACY meaning included, with a DeprecationWarning naming the words that say the same today."""
    kinds = frozenset().union(*(WORDS[word] for word in words))
    legacy = LEGACY[keyword]
    wider = frozenset().union(*(legacy.get(word, WORDS[word]) for word in words))
    if wider != kinds:
        extra = tuple(word_for(kind) for kind in FailureKind if kind in wider - kinds)
        old = ", ".join(repr(word) for word in words if not legacy.get(word, kinds) <= kinds)
        label, close = ("restart_on=", "") if keyword == "restart_on" else ("Retries(on=", ")")
        warnings.warn(
            f"{label}{words!r}{close}: {old} also named {', '.join(map(repr, extra))} failures before restart_on= "
            f"and retries= shared one vocabulary, and still does; each word will name its own kind only. "
            f"Pass {label}{words + extra!r}{close} to keep this meaning without the warning.",
            DeprecationWarning,
            stacklevel=_outside_levers9(),
        )
    return wider


def words_adding(words: tuple[str, ...], kind: FailureKind, keyword: str) -> tuple[str, ...]:
    """`words` (checked, for `keyword`) plus the word for `kind`, spelled to mean what they meant before
    (every kind a word once covered named by its own word), so passing them warns of nothing."""
    asked = words if word_for(kind) in words else (*words, word_for(kind))
    legacy = LEGACY[keyword]
    wider = frozenset().union(*(legacy.get(word, WORDS[word]) for word in asked))
    return asked + tuple(word_for(k) for k in FailureKind if k in wider and word_for(k) not in asked)


def _outside_levers9() -> int:
    """The stacklevel of the innermost frame outside the levers9 package, so a warning names the user's line."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def restart_policy(max_restarts: object, restart_on: object, restart_delay: object) -> RetryPolicy:
    """distributed.run's max_restarts= / restart_on= / restart_delay= (None: the default) as a policy;
    ConfigError on a bad one."""
    count = 0 if max_restarts is None else checked_max_restarts(max_restarts)
    words = DEFAULT_RESTART_ON if restart_on is None else _check_words(restart_on)
    delay = DEFAULT_RESTART_DELAY_S if restart_delay is None else restart_delay
    if not is_seconds(delay, zero_ok=True):
        raise ConfigError(
            f"restart_delay={restart_delay!r}; expected a number of seconds >= 0 to wait between attempts. "
            f"Pass e.g. restart_delay=5, or leave it unset for {DEFAULT_RESTART_DELAY_S:g} s."
        )
    return RetryPolicy(count, words, kinds_of(words, "restart_on"), float(delay))


def checked_max_restarts(value: object, error: type[ConfigError] = ConfigError, also: str = "") -> int:
    """`value` as a count of restarts (a whole number >= 0), else `error` saying so; `also` ends its message."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise error(
            f"max_restarts={value!r}; expected a whole number >= 0 (how often every rank may be started "
            f"again after a failure). Pass e.g. max_restarts=3, or 0 for none.{also}"
        )
    return value


def _check_words(restart_on: object) -> tuple[str, ...]:
    known = tuple(WORDS)
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
