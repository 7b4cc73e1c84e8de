"""Patching torch.distributed's blocking calls so a rank's slot on the progress board knows when it is in one."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from levers9.distributed.stalls.board import RankSlot

# The torch.distributed calls that block until every rank takes part (those a torch lacks are skipped).
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "send_object_list",
    "recv_object_list",
)


def instrument_collectives(slot: RankSlot) -> None:
    """Wrap torch.distributed's blocking collectives so the slot knows when this rank is in one.

    DDP all-reduces gradients inside backward(), in C++, and waits for them before backward returns:
    once this process has built a DistributedDataParallel model, backward() counts as a collective
    too ("DDP backward"), so a rank stuck there is seen like one stuck in all_reduce.
    """
    import torch.autograd
    import torch.distributed as td
    from torch.nn.parallel import DistributedDataParallel

    for name in COLLECTIVES:
        original = getattr(td, name, None)
        if original is None or getattr(original, "__levers9_wrapped__", False):
            continue
        setattr(td, name, tracked_call(original, name, slot))

    if getattr(torch.autograd.backward, "__levers9_wrapped__", False):
        return
    ddp_built = [False]
    original_init = DistributedDataParallel.__init__

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        ddp_built[0] = True

    DistributedDataParallel.__init__ = init  # type: ignore[method-assign]
    original_backward = torch.autograd.backward
    tracked_backward = tracked_call(original_backward, "DDP backward", slot)

    @functools.wraps(original_backward)
    def backward(*args: Any, **kwargs: Any) -> Any:
        return (tracked_backward if ddp_built[0] else original_backward)(*args, **kwargs)

    backward.__levers9_wrapped__ = True  # type: ignore[attr-defined]
    torch.autograd.backward = backward  # Tensor.backward looks it up here at every call


def tracked_call(original: Callable[..., Any], name: str, slot: RankSlot) -> Callable[..., Any]:
    @functools.wraps(original)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        slot.enter(name)  # async calls (and NCCL's, which return once enqueued) count as issued too
        try:
            return original(*args, **kwargs)
        finally:
            slot.leave(name)

    tracked.__levers9_wrapped__ = True  # type: ignore[attr-defined]
    return tracked
