"""Child side: what runs inside a job process, the same for every backend.

`TaskPayload` is what a cluster's task (Ray, SLURM) is given for one attempt of one cell and `TaskEnded` what it
reports back; `job_env` is the
environment a job sees; `JobTarget` is what levers9.procs runs in the job process, carrying its JobContext.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from levers9 import runtime
from levers9.errors import NotShippableError
from levers9.launch.spec import JobSpec
from levers9.private_dir import private_dir
from levers9.procs.failure import ship, ship_value, unship
from levers9.procs.outcome import Outcome, wall_clock
from levers9.procs.watch import pid_alive
from levers9.runtime import GangContext, JobContext, Runtime


@dataclasses.dataclass(frozen=True)
class GangSlot:
    """Where an attempt across nodes was placed: a Ray placement group, one bundle per node of `share` cards of
    `gpu_type` ("": any)."""

    pg: Any  # ray.util.placement_group.PlacementGroup
    share: int
    nodes: int
    gpu_type: str


@dataclasses.dataclass(frozen=True)
class TaskPayload:
    """One attempt of one cell, as a cluster's task gets it (a Ray task; each task of a SLURM job). A backend sets
    the fields after `attempt` that its tasks read."""

    sys_path: tuple[str, ...]  # the caller's import path, so the function unpickles on the node
    func: bytes  # the job's function, shipped
    arguments: bytes  # (args, kwargs), shipped
    spec: JobSpec
    run_id: str
    index: int  # the cell
    attempt: int = 0  # set per attempt (1 first)
    gpu_type: str = ""  # the plan's card type ("": any, or read from the cards)
    gang: GangSlot | None = None  # Ray, across nodes: the placement group, set per attempt
    tasks: int = 1  # SLURM: the job's tasks (one per rank across nodes; one runs a whole job)
    restart: int = 0  # SLURM, across nodes: restarts so far of this attempt (max_restarts=), a new job each
    requeue: bool = False  # SLURM: requeue at the time limit's early signal (launch/slurm/task.py)
    folder: str = ""  # SLURM: the batch's folder of job files, which every node shares
    result_path: str = ""  # a detached job's own store of its value, for resume ("" when not detached)
    secret: str = ""  # SLURM, across nodes: the group's keys start with it (slurm_task._meeting_place)

    def use_sys_path(self) -> None:
        """Put the caller's import path first on this process's, as the caller had it."""
        for entry in reversed(self.sys_path):
            if entry not in sys.path:
                sys.path.insert(0, entry)

    def call(self) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        """The job's function and its arguments, unshipped (after `use_sys_path`)."""
        args, kwargs = unship(self.arguments)
        return unship(self.func), args, kwargs


@dataclasses.dataclass(frozen=True)
class TaskEnded:
    """How a cluster's task ended where it ran (a Ray task's last item; each SLURM task's result file): its
    Outcome, when (wall clock: a failure's own time, so the caller orders several nodes' failures on its clock),
    and, for a rank of a job across nodes, which and on what node."""

    outcome: Outcome
    time: float
    rank: int = 0
    node: str = ""

    @classmethod
    def of(cls, outcome: Outcome, rank: int = 0, node: str = "") -> TaskEnded:
        failed = outcome.failure
        return cls(outcome, time.time() if failed is None else wall_clock(failed.when), rank, node)


def job_env(spec: JobSpec, nvml_indices: list[int]) -> dict[str, str]:
    """The variables a job process gets on top of the caller's environment: its cards, thread counts, the user's."""
    env = dict(spec.env)
    if spec.cpu is not None:
        threads = str(max(1, math.ceil(spec.cpu)))
        env.setdefault("OMP_NUM_THREADS", threads)
        env.setdefault("MKL_NUM_THREADS", threads)
    env.update(CUDA_VISIBLE_DEVICES=",".join(map(str, nvml_indices)), CUDA_DEVICE_ORDER="PCI_BUS_ID")
    return env


@dataclasses.dataclass(frozen=True)
class JobTarget:
    """One cell's call, as the child layer runs it in the job process: its context, then func(*args, **kwargs)."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    context: JobContext

    def __call__(self) -> bytes:
        """`call()`, its value shipped for the caller."""
        return ship_value(self.call(), "the job's return value")

    def call(self) -> Any:
        """Enter the job's context, apply its cards' quirks (once, for every rank it may start), call the
        function; its value."""
        runtime.begin(Runtime(job=self.context))
        if _on_real_cards(self.context):
            # imported for a job on real cards only: the rows read NVML and NCCL
            from levers9.distributed.hardware import quirks

            quirks.apply_quirks(local_world_size=self.context.gpu_count, backend="nccl", is_main=True)
        return self.func(*self.args, **self.kwargs)


def quirk_env(context: JobContext, ranks_env: Mapping[str, str]) -> dict[str, str]:
    """The variables the quirks of the job's cards set where neither os.environ nor `ranks_env` does, for
    ranks started by a process that must stay as it is (a further node's agent, in a Ray worker that later
    tasks reuse); node 0's job process applies its plan itself as it starts."""
    if not _on_real_cards(context):
        return {}
    from levers9.distributed.hardware import quirks  # on real cards only: the rows read NVML and NCCL

    plan = quirks.plan_quirks(local_world_size=context.gpu_count, backend="nccl", env={**os.environ, **ranks_env})
    plan.raise_errors()
    return plan.set_env


def _on_real_cards(context: JobContext) -> bool:
    """True for a job on cards NVML shows: their world is one rank per card on nccl (distributed.run's
    layout on real cards), which the quirks are planned for."""
    return context.gpu_count > 0 and not context.simulated


def ship_for(value: Any, name: str, where: str, fix: str) -> bytes:
    """`value` pickled to reach `where` (a fresh interpreter, a Ray task, a SLURM job), or NotShippableError
    naming `name` and saying `fix`."""
    try:
        return ship(value)
    except Exception as exc:
        raise NotShippableError(f"{name} cannot be sent to {where} ({type(exc).__name__}: {exc}). {fix}") from exc


def ship_target(target: JobTarget) -> bytes:
    return ship_for(target, getattr(target.func, "__qualname__", repr(target.func)),
                    "a fresh interpreter, which is how jobs start when this process has already initialised CUDA",
                    "Define it at module level, or start the jobs before touching CUDA in this process.")  # fmt: skip


def task_context(spec: JobSpec, run_id: str, index: int, attempt: int, job_dir: str, ids: list[str], gpu_type: str = "",
                 gang: GangContext | None = None) -> JobContext:  # fmt: skip
    """The JobContext of a job that a scheduler's task runs (Ray, SLURM) on the cards `ids` it was given;
    they are simulated when NVML shows none of them (a CPU node declared with GPUs, as in tests: the ranks
    run on gloo, as locally). `gpu_type` is read from the cards when not given."""
    simulated = False
    if ids:
        from levers9.distributed.hardware.cards import visible_cards

        cards = visible_cards({"CUDA_VISIBLE_DEVICES": ",".join(ids), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
        simulated = len(cards) < len(ids)
        if not gpu_type and cards and not simulated:
            gpu_type = cards[0].type_name
    return JobContext(run_id=run_id, cell_index=index, attempt=attempt, job_dir=job_dir, gpu_count=len(ids),
                      gpu_type=gpu_type if ids else "", simulated=simulated, stall_timeout=spec.stall_timeout,
                      max_restarts=spec.max_restarts, gang=gang)  # fmt: skip


def scratch_dir(kind: str, index: int, attempt: int) -> Path:
    """A fresh scratch folder (a job's `job_dir` on its node) for cell `index`'s attempt, under this user's
    private root for `kind` ("ray", "slurm") of tasks. Folders of tasks killed before they could clean up
    (a cancel, a lost caller, a time limit) are removed first, so none accumulates in the temp folder."""
    root = Path(tempfile.gettempdir()) / f"levers9-{kind}-{os.getuid()}"
    for _ in range(10):
        try:  # the task that empties the root removes it: it can vanish at any step below
            private_dir(root)
            with contextlib.suppress(OSError):
                for stale in root.iterdir():
                    owner = stale.name.partition("-")[0]
                    if owner.isdigit() and not pid_alive(int(owner)):
                        shutil.rmtree(stale, ignore_errors=True)
            return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-{index:04d}-{attempt}-", dir=root))
        except FileNotFoundError:
            continue
    return Path(tempfile.mkdtemp(prefix=f"levers9-{kind}-{os.getpid()}-"))


def remove_scratch_dir(folder: Path) -> None:
    """Remove a folder `scratch_dir` made, and its root once no other job uses it."""
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        folder.parent.rmdir()
