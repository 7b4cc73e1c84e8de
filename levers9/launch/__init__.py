"""The job layer: `@job` functions run as jobs on this machine's cards (or a Ray or SLURM cluster).

from levers9.launch import job, Retries
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from levers9.launch.job_function import JobFunction, job
    from levers9.launch.map_results import MapResults
    from levers9.launch.spec import JobSpec
    from levers9.retries import Retries

__all__ = ["job", "Retries", "JobFunction", "MapResults", "JobSpec"]

# Each public name loads with its module on first use, not with the package: a SLURM or Ray task imports
# only the job-process side of levers9.launch, and `@job`'s module (backends, the live table, rich) would
# add about 40 ms to every cell there.
_HOME = {
    "job": "levers9.launch.job_function",
    "JobFunction": "levers9.launch.job_function",
    "MapResults": "levers9.launch.map_results",
    "JobSpec": "levers9.launch.spec",
    "Retries": "levers9.retries",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'levers9.launch' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value
