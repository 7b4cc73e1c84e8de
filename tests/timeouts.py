"""Testing what timeout= does to a job's function once it runs, whatever the machine's load.

A job's timeout counts from its process starting (on SLURM, from its task's interpreter starting), so under a
loaded CI machine or a slow SLURM start a short timeout can end the job before its function wrote anything, and
the test would have nothing to look at. Rather than a timeout long enough for the slowest machine (a time margin
that a busier one breaks, and a cost on every fast one), the timeout grows until the function had started.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from levers9.errors import JobTimeout

TIMEOUTS = (2, 8, 30)  # seconds: the first is the test's point; the others only give a slow start its time


def timed_out_once_started(run: Callable[[int], object], started: Callable[[], bool], match: str = "") -> int:
    """Calls `run(timeout)` (which must raise JobTimeout, its message matching `match` with {timeout} filled in)
    with each of TIMEOUTS until `started()` says the function had begun before the timeout; that timeout."""
    for timeout in TIMEOUTS:
        with pytest.raises(JobTimeout, match=(match or "timeout={timeout}s").format(timeout=timeout)):
            run(timeout)
        if started():
            return timeout
    pytest.fail(f"the job's function never started within timeout={TIMEOUTS[-1]}s: nothing was tested")
