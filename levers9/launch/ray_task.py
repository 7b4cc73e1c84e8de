"""What a Ray task of levers9 is given: the typed payload of a job's task (launch/ray_backend.py) and of an agent's
task on another node of a job across nodes (launch/ray_gang.py). No Ray import."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from levers9.context import GangContext
from levers9.launch.spec import JobSpec


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
