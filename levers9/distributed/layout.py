"""How many ranks a run started here has, and on which backend: one per visible card, or what nprocs= says."""

from __future__ import annotations

import dataclasses

from levers9.distributed import devices
from levers9.errors import ConfigError
from levers9.runtime import current_job


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
            f"nprocs={nprocs} but only {cards} card(s) are visible{devices.visible_devices_note()}: ranks {cards}..{nprocs - 1} would "
            f"have no card. Expected one card per rank; pass nprocs<={cards}, or backend='gloo' to run "
            f"{nprocs} ranks on the CPU."
        )
    return Layout(nprocs or cards, "nccl")
