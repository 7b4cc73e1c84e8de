"""Child side: what runs inside a job process, the same for every backend.

`job_env` is the environment a job sees (its cards, LEVERS9_* facts about the job, the user's env).
A JobTarget is what levers9.procs runs in the job process: it applies GPU quirks on real cards,
calls the function and ships its value back; the child layer sends that, or the failure, to the caller.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from levers9.errors import NotShippableError
from levers9.launch.spec import JobSpec
from levers9.procs.failure import ship, ship_value


def job_env(
    spec: JobSpec,
    *,
    nvml_indices: list[int],
    gpu_type: str,
    simulated: bool,
    run_id: str,
    cell_index: int,
    attempt: int,
    job_dir: Path,
) -> dict[str, str]:
    """The variables a job process gets on top of the caller's environment."""
    env = dict(spec.env)
    if spec.cpu is not None:
        threads = str(max(1, math.ceil(spec.cpu)))
        env.setdefault("OMP_NUM_THREADS", threads)
        env.setdefault("MKL_NUM_THREADS", threads)
    env.update(
        CUDA_VISIBLE_DEVICES=",".join(map(str, nvml_indices)),
        CUDA_DEVICE_ORDER="PCI_BUS_ID",
        LEVERS9_RUN_ID=run_id,
        LEVERS9_JOB_ID=f"{run_id}/{cell_index}",
        LEVERS9_CELL_INDEX=str(cell_index),
        LEVERS9_ATTEMPT=str(attempt),
        LEVERS9_GPU_COUNT=str(len(nvml_indices)),
        LEVERS9_GPU_TYPE=gpu_type,
        LEVERS9_JOB_DIR=str(job_dir),
    )
    if simulated and nvml_indices:
        env["LEVERS9_SIMULATED"] = "1"
    if spec.stall_timeout is not None:
        env["LEVERS9_STALL_TIMEOUT"] = repr(spec.stall_timeout)
    return env


@dataclasses.dataclass(frozen=True)
class JobTarget:
    """One cell's call, as the child layer runs it in the job process: its environment, then func(*args, **kwargs)."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    env: Mapping[str, str]

    def __call__(self) -> bytes:
        """Apply the job's environment and quirks, call the function, ship its value for the caller."""
        if "LEVERS9_SIMULATED" not in self.env:
            os.environ.pop("LEVERS9_SIMULATED", None)
        gpu_count = int(self.env.get("LEVERS9_GPU_COUNT", "0"))
        if gpu_count > 0 and self.env.get("LEVERS9_SIMULATED") != "1":
            from levers9.distributed.hardware import quirks

            quirks.apply_quirks(local_world_size=gpu_count, backend="nccl", is_main=True)
        return ship_value(self.func(*self.args, **self.kwargs), "the job's return value")


def ship_target(target: JobTarget) -> bytes:
    """The target pickled for a fresh interpreter, or NotShippableError naming the function."""
    try:
        return ship(target)
    except Exception as exc:
        name = getattr(target.func, "__qualname__", repr(target.func))
        raise NotShippableError(
            f"{name} cannot be sent to a fresh interpreter ({type(exc).__name__}: {exc}), which is how jobs start "
            f"when this process has already initialised CUDA. Define it at module level, or start the jobs "
            f"before touching CUDA in this process."
        ) from exc
