"""The job layer: `@job` functions run as jobs on this machine's cards (or a Ray cluster).

from levers9.launch import job, Retries
"""

from __future__ import annotations

from levers9.launch.job import JobFunction, MapResults, job
from levers9.launch.spec import JobSpec
from levers9.retries import Retries

__all__ = ["job", "Retries", "JobFunction", "MapResults", "JobSpec"]
