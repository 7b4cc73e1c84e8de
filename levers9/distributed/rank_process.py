"""Child side: what runs inside each rank that `distributed.run` started, from a RankTarget: the process group
joined before fn (unless fn makes its own: `init_group=False`, run_script, spawn), fn called, rank 0's value shipped
back (every other rank sends None). Failures travel through procs' codec.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

from levers9 import runtime
from levers9.distributed import group, stalls
from levers9.procs.failure import ship_value, unship
from levers9.runtime import JobContext, Runtime


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to know about its place, given by the parent."""

    rank: int
    world_size: int
    backend: str  # "gloo" ranks compute on the CPU, even where cards are present
    board_folder: str | None  # the stall board and stack files, when timeout= or stall_timeout= asked for them
    job: JobContext | None  # the job that called distributed.run, if any
    make_group: bool = True  # join the process group before fn (False: fn makes its own, as under torchrun)
    pass_rank: bool = False  # call fn(rank) (distributed.spawn), not fn()
    board_slot: int | None = None  # its slot on the board folder's board (a node's local rank across nodes); None: rank


@dataclasses.dataclass(frozen=True)
class RankTarget:
    """fn bound to cfg for one rank: as it is (forked ranks) or shipped as bytes (fresh interpreters)."""

    spec: RankSpec
    call: Callable[..., Any] | bytes

    def __call__(self) -> bytes | None:
        return rank_main(self.spec, unship(self.call) if isinstance(self.call, bytes) else self.call)


def rank_main(spec: RankSpec, call: Callable[..., Any]) -> bytes | None:
    """Run fn on this rank; rank 0's value shipped for the caller, None on the others."""
    runtime.begin(Runtime(job=spec.job, quirks_from_parent=True, cpu_only=spec.backend == "gloo"))
    torch = sys.modules.get("torch")
    if torch is not None and os.environ.get("OMP_NUM_THREADS") == "1" and torch.get_num_threads() != 1:
        torch.set_num_threads(1)  # a forked rank keeps the caller's thread pool; a fresh one reads the variable
    board_slot = spec.rank if spec.board_slot is None else spec.board_slot
    slot = None if spec.board_folder is None else stalls.watch_this_rank(spec.board_folder, board_slot)
    with group.joined(spec.backend, slot) if spec.make_group else contextlib.nullcontext():
        result = call(spec.rank) if spec.pass_rank else call()
        return ship_value(to_cpu(result), "rank 0's return value") if spec.rank == 0 else None


def to_cpu(value: Any) -> Any:
    """`value` with every tensor inside dicts, lists and tuples moved to the CPU (the parent must not touch CUDA)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if type(value) is dict:
        return {k: to_cpu(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(to_cpu(v) for v in value)
    return value
