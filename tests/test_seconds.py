"""A number of seconds means one thing wherever levers9 takes one: the one rule (levers9.seconds), and
distributed.run, @job and restart_delay= refusing the same values with their own messages; and one is said the
same way in the sweep's status table and in `levers9 runs`. No process is started."""

from __future__ import annotations

import math
from typing import Any

import pytest

from levers9 import distributed as dist
from levers9.errors import ConfigError, JobConfigError
from levers9.launch import job
from levers9.retries import restart_policy
from levers9.seconds import is_seconds, say_duration
from tests import rankfns

pytestmark = pytest.mark.fast

NOT_SECONDS = [math.nan, math.inf, -math.inf, -1, -0.5, True, False, "3", None, [3]]


@pytest.mark.parametrize(("value", "above_zero", "zero_or_more"), [
    (3, True, True), (0.25, True, True), (1e9, True, True), (0, False, True), (0.0, False, True),
    *((value, False, False) for value in NOT_SECONDS),
])  # fmt: skip
def test_the_one_rule(value: Any, above_zero: bool, zero_or_more: bool) -> None:
    assert is_seconds(value, zero_ok=False) is above_zero
    assert is_seconds(value, zero_ok=True) is zero_or_more


@pytest.mark.parametrize("value", [v for v in NOT_SECONDS if v is not None])
def test_every_argument_in_seconds_refuses_the_same_values(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"timeout=.*expected a finite positive number of seconds"):
        dist.run(rankfns.describe, None, nprocs=2, timeout=value)
    with pytest.raises(JobConfigError, match="timeout must be a positive number of seconds"):
        job(timeout=value)(rankfns.describe)
    with pytest.raises(ConfigError, match="restart_delay=.*expected a number of seconds >= 0"):
        restart_policy(None, None, value)


def test_zero_is_a_grace_or_a_delay_but_never_a_limit() -> None:
    assert restart_policy(None, None, 0).delay(2) == 0.0
    assert job(stop_grace=0)(rankfns.describe) is not None
    with pytest.raises(ConfigError, match="timeout=0"):
        dist.run(rankfns.describe, None, nprocs=2, timeout=0)
    with pytest.raises(JobConfigError, match="got 0"):
        job(timeout=0)(rankfns.describe)


@pytest.mark.parametrize(("seconds", "said", "said_in_tenths"), [
    (0, "0s", "0.0s"), (4.25, "4s", "4.2s"), (59.7, "59s", "59.7s"), (60, "1m00s", "1m00s"),
    (187.9, "3m07s", "3m07s"), (3599, "59m59s", "59m59s"), (7500, "2h05m", "2h05m"), (90061, "25h01m", "25h01m"),
])  # fmt: skip
def test_a_duration_is_said_in_whole_seconds_minutes_or_hours(seconds: float, said: str, said_in_tenths: str) -> None:
    """The status table's summary says whole seconds; `levers9 runs` keeps tenths under a minute."""
    assert say_duration(seconds) == said
    assert say_duration(seconds, tenths=True) == said_in_tenths
