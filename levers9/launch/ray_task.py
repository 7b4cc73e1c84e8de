"""What a Ray task of levers9 is given: the typed payload of a job's task (launch/ray_backend.py) and of an agent's
task on another node of a job across nodes (launch/ray_gang.py), and what both tasks do first on their node (their
cards, their scratch folder). No Ray import."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from levers9.context import GangContext
from levers9.launch.spec import JobSpec
from levers9.private_dir import private_dir
from levers9.procs.watch import pid_alive


@dataclasses.dataclass(frozen=True)
class GangSlot:
    """A job's placement group across nodes, one bundle per node of `share` cards of `gpu_type` ("": any)."""

    pg: Any  # ray.util.placement_group.PlacementGroup
    share: int
    nodes: int
    gpu_type: str


@dataclasses.dataclass(frozen=True)
class TaskPayload:
    """One attempt of one cell, as its Ray task gets it."""

    sys_path: tuple[str, ...]  # the caller's import path, so the function unpickles on the node
    func: bytes  # the job's function, shipped
    arguments: bytes  # (args, kwargs), shipped
    spec: JobSpec
    run_id: str
    index: int  # the cell
    gpu_type: str  # the plan's card type ("": any)
    attempt: int = 0  # set per attempt (1 first)
    gang: GangSlot | None = None  # across nodes: the placement group, set per attempt

    def use_sys_path(self) -> None:
        """Put the caller's import path first on this process's, as the caller had it."""
        for entry in reversed(self.sys_path):
            if entry not in sys.path:
                sys.path.insert(0, entry)


@dataclasses.dataclass(frozen=True)
class AgentPayload:
    """What an agent's Ray task on node `gang.node_index` gets: its job's task payload (no placement group), the
    gang as that node sees it, and which agent of that node it is."""

    task: TaskPayload
    gang: GangContext
    generation: int  # one more per replacement of the node's agent; an older one exits
    first_attempt: int  # the attempt it starts at (a replacement joins a restart)


# ---- inside a task, on its node


def scratch_dir(index: int, attempt: int) -> Path:
    """A folder for the job (its context's job_dir), removed when the task ends. Folders of
    tasks whose worker was killed (cancel, lost caller) are removed by the next task on the node."""
    root = Path(tempfile.gettempdir()) / f"levers9-ray-{os.getuid()}"
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
    return Path(tempfile.mkdtemp(prefix=f"levers9-ray-{os.getpid()}-"))
