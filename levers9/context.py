"""What a job process knows about the job it runs: one typed value, handed over with the job's function.

The job layer builds a JobContext for each attempt and hands it to the job process inside the job's
target (as it is when forked, pickled for a fresh interpreter), never through environment variables.
`distributed.run` inside the job reads it: the job's cards (simulated or real) decide how many ranks
start and on which backend, and its stall_timeout and max_restarts are the run's defaults. Ranks started there carry it
on. The job's own code can ask `levers9.current_job()` which run, cell and attempt it is.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class JobContext:
    """One attempt of one cell: where it belongs, its cards, and the limits `distributed.run` inherits."""

    run_id: str
    cell_index: int
    attempt: int
    job_dir: str
    gpu_count: int = 0
    gpu_type: str = ""
    simulated: bool = False  # the cards are LEVERS9_SIMULATE_GPUS's: ranks compute on the CPU with gloo
    stall_timeout: float | None = None
    max_restarts: int = 0

    @property
    def job_id(self) -> str:
        """'<run id>/<cell index>', as `levers9 runs` names a cell."""
        return f"{self.run_id}/{self.cell_index}"


_current: JobContext | None = None


def current_job() -> JobContext | None:
    """The job this process runs (in a job process and in the ranks it started), else None."""
    return _current


def enter_job(context: JobContext | None) -> None:
    """Make `context` this process's job (the child side of the job layer calls this before the function)."""
    global _current
    _current = context
