"""Which device this process computes on: a card (one per local rank) or the CPU, and the backend that follows.

Read by the helpers (`device()`), by the group levers9 makes (nccl needs the rank's card as current device
first) and by the run's layout; kept apart from the group's life (group.py).
"""

from __future__ import annotations

import os

from levers9 import runtime
from levers9.errors import DeviceError


def cpu_only() -> bool:
    """True in a rank of a gloo run: it computes on the CPU even where CUDA is present."""
    return runtime.this_process().cpu_only


def wants_cuda() -> bool:
    """True if this process should compute on a card (CUDA present and not forced onto the CPU)."""
    if cpu_only() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return False
    import torch

    return bool(torch.cuda.is_available())


def default_backend() -> str:
    """nccl where this process computes on a card, else gloo."""
    return "nccl" if wants_cuda() else "gloo"


def visible_devices_note() -> str:
    """' (CUDA_VISIBLE_DEVICES=...)' when that variable is set, for messages about card counts."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""


def cuda_index_for_local_rank(local_rank: int) -> int:
    """The card index for this local rank, set as the current device; DeviceError if there is no such card."""
    import torch

    count = torch.cuda.device_count()
    if local_rank >= count:
        raise DeviceError(
            f"LOCAL_RANK={local_rank} but this process sees only {count} card(s){visible_devices_note()}: local rank "
            f"{local_rank} has no card of its own. Expected one card per local rank; start at most {count} "
            f"processes per node (e.g. `torchrun --nproc-per-node {count}`, or distributed.run(..., nprocs={count}))."
        )
    if torch.cuda.current_device() != local_rank:
        torch.cuda.set_device(local_rank)
    return local_rank
