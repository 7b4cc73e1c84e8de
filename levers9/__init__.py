"""levers9: one training function on 1, 2, 4 or 8 GPUs.

    from levers9 import distributed as dist   # the drop-in shim for torchrun / accelerate / its own spawner
    from levers9 import job                   # the job layer: @job, .remote, .spawn, .map

Submodules load on first use, so `import levers9` stays cheap (no torch import).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from levers9.runtime import JobContext, current_job

__version__ = "0.1.0"
__all__ = ["distributed", "launch", "job", "current_job", "JobContext", "__version__"]

if TYPE_CHECKING:
    from levers9 import distributed, launch
    from levers9.launch import job


def __getattr__(name: str) -> Any:
    if name in ("distributed", "launch"):
        return importlib.import_module(f"levers9.{name}")
    if name == "job":
        return importlib.import_module("levers9.launch").job
    raise AttributeError(f"module 'levers9' has no attribute {name!r}")

