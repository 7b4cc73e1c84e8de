"""What levers9 knows about this process, as one typed value, built where a rank or a job process starts.

A job process begins with its JobContext (launch/job_process.py); a rank of `distributed.run` with its
job's context, the mark that its parent applied the quirks for it, and whether it computes on the CPU
(distributed/rank_process.py); any other process has the empty value. The value is kept process-wide,
once, because what reads it is process-wide by nature: torch's default process group (which levers9
may have made, and then alone destroys), the environment the quirks set, and the helpers and
`levers9.current_job()` that user code calls with no argument.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from levers9.context import JobContext
    from levers9.distributed.hardware.quirk_rows import QuirkPlan


@dataclasses.dataclass
class Runtime:
    """This process, in levers9's eyes."""

    job: JobContext | None = None  # the job this process runs (a job process, and the ranks it started)
    quirks: QuirkPlan | None = None  # the plan applied in this process (a job process, in place, under a launcher)
    # a rank distributed.run started: its parent planned the quirks for all its ranks and handed their variables
    # down in this rank's environment, so the rank plans none of its own
    quirks_from_parent: bool = False
    cpu_only: bool = False  # a rank of a gloo run: it computes on the CPU even where CUDA is present
    own_group: bool = False  # levers9 made the default process group (it destroys no other)
    groups_made: int = 0  # groups levers9 made on a launcher's store here: each gets store keys of its own


_this_process = Runtime()


def this_process() -> Runtime:
    """This process's Runtime (the empty one unless a rank or job began here)."""
    return _this_process


def begin(runtime: Runtime) -> None:
    """Make `runtime` this process's: the child side of a rank or job calls this before the user's function
    (a forked child must not keep what its parent knew about itself)."""
    global _this_process
    _this_process = runtime


def current_job() -> JobContext | None:
    """The job this process runs (in a job process and in the ranks it started), else None."""
    return _this_process.job
