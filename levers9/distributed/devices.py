"""Which device this process computes on: a card (one per local rank) or the CPU, and the backend that follows.

Read by the helpers (`device()`), by the group levers9 makes (nccl needs the rank's card as current device
first) and by the run's layout; kept apart from the group's life (group.py).
"""

from __future__ import annotations

import dataclasses
import os

from levers9 import runtime
from levers9.errors import ConfigError, DeviceError
from levers9.runtime import current_job


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


@dataclasses.dataclass(frozen=True)
class Layout:
    """How many ranks to start, and on which backend (gloo ranks compute on the CPU)."""

    nprocs: int
    backend: str


def visible_card_count() -> int:
    """How many cards this process may use, without initialising CUDA (NVML-based count)."""
    import torch

    return int(torch.cuda.device_count())  # 0 at once on a CPU build


def plan_layout(nprocs: int | None, backend: str | None) -> Layout:
    """Ranks and backend for a run started here; a clear error for impossible combinations."""
    if nprocs is not None and (isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1):
        raise ConfigError(f"nprocs={nprocs!r}; expected a whole number >= 1, or None for one rank per visible card.")
    if backend is not None and backend not in ("nccl", "gloo"):
        raise ConfigError(f"backend={backend!r}; expected 'nccl', 'gloo' or None (nccl on cards, gloo on the CPU).")
    job = current_job()
    if job is not None and job.simulated:  # a job on simulated cards: one CPU rank per card
        return Layout(nprocs or job.gpu_count, "gloo")
    cards = visible_card_count()
    if backend == "gloo" or (cards == 0 and backend is None):
        return Layout(nprocs or 1, "gloo")
    if cards == 0:
        raise ConfigError(
            "backend='nccl' but this process sees no CUDA card. Expected at least one card; "
            "pass backend='gloo' (or leave backend unset) to run on the CPU."
        )
    if nprocs is not None and nprocs > cards:
        raise ConfigError(
            f"nprocs={nprocs} but only {cards} card(s) are visible{visible_devices_note()}: ranks {cards}..{nprocs - 1} would "
            f"have no card. Expected one card per rank; pass nprocs<={cards}, or backend='gloo' to run "
            f"{nprocs} ranks on the CPU."
        )
    return Layout(nprocs or cards, "nccl")
