"""Child side: what runs inside each rank that `distributed.run` started.

The parent starts each rank through levers9.procs with a RankTarget; the rank sets up the stall
board, takes its place in the world (torchrun's variables), calls fn and ships rank 0's value back
(every other rank sends None). The group is made lazily: by fn's own init_process_group, or on first
need by a levers9 helper or a torch.distributed collective. Failures travel through procs' failure codec.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from levers9.context import JobContext, enter_job
from levers9.distributed import stalls
from levers9.procs.failure import ship_value, unship


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to know about its place, given by the parent."""

    rank: int
    world_size: int
    backend: str
    call_without_cfg: bool
    run_folder: str
    use_cuda: bool
    job: JobContext | None  # the job that called distributed.run, if any


@dataclasses.dataclass(frozen=True)
class RankTarget:
    """fn and cfg for one rank: as they are (forked ranks) or shipped as bytes (fresh interpreters)."""

    spec: RankSpec
    fn_and_cfg: tuple[Callable[..., Any], Any] | bytes

    def __call__(self) -> bytes | None:
        fn, cfg = unship(self.fn_and_cfg) if isinstance(self.fn_and_cfg, bytes) else self.fn_and_cfg
        return rank_main(self.spec, fn, cfg)


def rank_main(spec: RankSpec, fn: Callable[..., Any], cfg: Any) -> bytes | None:
    """Run fn on this rank; rank 0's value shipped for the caller, None on the others."""
    from levers9.distributed import group
    from levers9.distributed.hardware import quirks

    enter_job(spec.job)
    quirks.mark_applied()  # the parent applied them for every rank, before starting any
    if not spec.use_cuda:
        group.compute_on_cpu()
    stalls.enable_stack_dumps(spec.run_folder, spec.rank)
    slot = stalls.RankSlot(spec.run_folder, spec.rank)
    stalls.instrument_collectives(slot)
    stalls.start_recorder_sampler(slot.record, spec.run_folder, spec.rank)
    try:
        # No group yet: fn may create it (init_process_group joins the parent's store), else it is
        # created on first need (a levers9 helper, or a torch.distributed collective with no group).
        group.prepare_lazy_group(slot)
        result = fn() if spec.call_without_cfg else fn(cfg)
        return ship_value(to_cpu(result), "rank 0's return value") if spec.rank == 0 else None
    finally:
        group.destroy_own_group()


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
