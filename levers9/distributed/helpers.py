"""The handful of helpers a training loop needs, each answering as a world of one when nothing launched us."""

from __future__ import annotations

import atexit
import builtins
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from levers9.distributed import detect, devices, group

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
# Process-wide, as torch's current CUDA device is: the device() answer per (local rank, cpu-only, ACCELERATE_USE_CPU).
_device_cache: dict[tuple[int, bool, str | None], torch.device] = {}


def device() -> torch.device:
    """This rank's card (`cuda:<local rank>`, made the current device), else `cpu`."""
    import torch

    local = detect.local_rank()
    key = (local, devices.cpu_only(), os.environ.get("ACCELERATE_USE_CPU"))
    if key not in _device_cache:
        index = devices.cuda_index_for_local_rank(local) if devices.wants_cuda() else None
        _device_cache[key] = torch.device("cpu") if index is None else torch.device("cuda", index)
    return _device_cache[key]


def wrap(model: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
    """`DistributedDataParallel` on `device()` when there are several ranks, else the model moved to `device()`.

    Never DataParallel, and never a second wrap: a model that is already DDP comes back as it is.

    Args:
        model: The module to train.
        **ddp_kwargs: Passed to DistributedDataParallel unchanged (`device_ids` and `output_device`
            default to this rank's card).

    Returns:
        The DDP-wrapped model, or in a world of one the model itself on `device()`.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model
    dev = device()
    model = model.to(dev)
    _ensure_group()
    if detect.world_size() <= 1:
        return model
    if dev.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [dev.index])
        ddp_kwargs.setdefault("output_device", dev.index)
    return DistributedDataParallel(model, **ddp_kwargs)


class PaddedShard(NamedTuple):
    """A rank's rows when every rank must get the same number: the rows and how many of them are padding."""

    rows: list[Any]
    padding: int


def _bounds(n: int, ranks: int, index: int) -> tuple[int, int]:
    """[start, end) of block `index` when n rows are cut into `ranks` blocks differing in length by at most one."""
    base, extra = divmod(n, ranks)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def shard(rows: Sequence[T], *, pad: bool = False) -> Any:
    """This rank's contiguous slice of `rows`; together the slices cover every row exactly once.

    Slice lengths differ by at most one. World of one: all rows.

    Args:
        rows: Any sequence (a list, a range, a dataset with `__len__` and slicing).
        pad: Give every rank the same number of rows (so every rank runs the same number of steps
            and DDP cannot hang on uneven data): short slices are topped up with rows from the
            start of the sequence (padding rows come last).

    Returns:
        The slice; with `pad=True` a `PaddedShard(rows, padding)` saying how many of this rank's
        rows are repeats.
    """
    ranks, index = detect.world_size(), detect.rank()
    start, end = _bounds(len(rows), ranks, index)
    mine = rows[start:end]
    if not pad:
        return mine
    longest = -(-len(rows) // ranks) if rows else 0
    padding = longest - (end - start)
    extra = [rows[i % len(rows)] for i in range(padding)] if rows else []
    return PaddedShard(list(mine) + extra, padding)


def all_reduce_mean(x: Any) -> torch.Tensor:
    """Mean of `x` across ranks, as a new detached tensor; `x` is untouched.

    Works on gloo (which has no AVG: sum, then divide) and on nccl (a CPU tensor goes to the card
    and the answer comes back to the CPU).

    Args:
        x: A tensor or a Python number; integer and bool inputs come back as floating point.

    Returns:
        The mean, on `x`'s device (a float64 tensor for a Python number); in a world of one a copy of `x`.
    """
    import torch

    out = x.detach().clone() if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64)
    if not out.is_floating_point() and not out.is_complex():
        out = out.to(torch.get_default_dtype())
    _ensure_group()  # under a launcher with several ranks and no group yet, make it now
    td = detect.live_group()
    if td is None or td.get_world_size() == 1:
        return out
    work = out.to(device() if td.get_backend() == "nccl" else "cpu")  # `out` itself where it already is
    td.all_reduce(work)
    return work.div_(td.get_world_size()).to(out.device)


def print0(*args: Any, **kwargs: Any) -> None:
    """`print` on global rank 0 only, flushed.

    Args:
        *args: As for `print`.
        **kwargs: As for `print` (`flush` defaults to True).
    """
    if detect.rank() == 0:
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)


def barrier() -> None:
    """Every rank waits here for every other; a no-op in a world of one."""
    _ensure_group()
    if detect.world_size() <= 1:
        return
    import torch.distributed as td

    td.barrier(device_ids=[device().index] if td.get_backend() == "nccl" else None)


def _ensure_group() -> None:
    """Under a launcher with several ranks and no group (helpers used without `distributed.run`): the quirks for
    the launcher's world applied, then the group made now; it is destroyed when the process exits."""
    if detect.live_group() is not None:  # the common case, checked first: every helper call comes here
        return
    info = detect.launch_info()
    if info.world_size <= 1:
        return
    from levers9.distributed.hardware import quirks  # loads on use, not with levers9.distributed

    quirks.apply_quirks(local_world_size=info.local_world_size, backend=devices.default_backend(), is_main=info.rank == 0)
    if group.join_launcher_group(info):
        atexit.register(group.destroy_own_group)


os.register_at_fork(after_in_child=_device_cache.clear)  # a forked rank has a device of its own
