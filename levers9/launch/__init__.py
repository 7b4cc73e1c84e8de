"""The job layer: `@job` functions run as jobs on this machine's cards (or a Ray or SLURM cluster).

from levers9.launch import job, Retries
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from levers9.lazy_names import lazy_names

if TYPE_CHECKING:
    from levers9.launch.job_function import JobFunction, job
    from levers9.launch.map_results import MapResults
    from levers9.launch.spec import JobSpec
    from levers9.retries import Retries

__all__ = ["job", "Retries", "JobFunction", "MapResults", "JobSpec"]

# Each public name loads with its module on first use, not with the package (levers9/lazy_names.py): a SLURM
# or Ray task imports only the job-process side of levers9.launch, and `@job`'s module (backends, the live
# table, rich) would add about 40 ms to every cell there.
__getattr__ = lazy_names(__name__, {
    "job": ".job_function",
    "JobFunction": ".job_function",
    "MapResults": ".map_results",
    "JobSpec": ".spec",
    "Retries": "levers9.retries",
})
