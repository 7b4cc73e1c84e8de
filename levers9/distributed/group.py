"""The default process group's life: made when first needed (quirks applied first), destroyed only by its maker.

Inside `distributed.run` no group exists before fn runs, on every path: fn may make it itself
(`init_process_group`, as torchrun code does), and otherwise the first levers9 helper or
torch.distributed collective that needs one makes it. levers9 destroys only a group it made; one the
user, accelerate or a launcher made is left alone.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import importlib
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlparse

from levers9.distributed import world
from levers9.distributed.detect import LaunchInfo
from levers9.errors import ConfigError, DeviceError, LauncherEnvError

DEFAULT_TIMEOUT_S = 600.0
# Set by distributed.run for its ranks: the loopback port of the rendezvous store the parent hosts.
STORE_PORT_VAR = "LEVERS9_STORE_PORT"

_created_by_us = False
_cpu_only = False
_lazy_backend: str | None = None  # inside lazy_group: the backend of a group made on first need
_stall_slot: Any = None  # in a rank of distributed.run: forming the group counts as waiting in a collective
_groups_formed = 0  # on a launcher's store, every group after the first gets keys of its own


def compute_on_cpu() -> None:
    """Make this process compute on the CPU even where CUDA is present (ranks of a gloo run)."""
    global _cpu_only
    _cpu_only = True


def cpu_only() -> bool:
    """True once compute_on_cpu() was called in this process."""
    return _cpu_only


def wants_cuda() -> bool:
    """True if this process should compute on a card (CUDA present and not forced onto the CPU)."""
    if _cpu_only or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return False
    import torch

    return bool(torch.cuda.is_available())


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


def destroy_own_group() -> None:
    """Destroy the default group if levers9 created it; leave anyone else's alone."""
    global _created_by_us
    if not _created_by_us:
        return
    _created_by_us = False
    td = world.live_group()
    if td is not None:
        # Let DDP models and pending work objects go first: gloo threads still holding them at
        # interpreter exit abort the process (pytorch/pytorch#190489, pytorch/pytorch#179291).
        gc.collect()
        td.destroy_process_group()


def apply_quirks_here(local_world_size: int, backend: str, disabled: tuple[str, ...] = ()) -> None:
    """Apply the GPU-quirk registry in this process before its first collective (once per process)."""
    from levers9.distributed.hardware import quirks

    quirks.apply_quirks(local_world_size=local_world_size, backend=backend, is_main=world.rank() == 0, disabled=disabled)


def join_launcher_group(info: LaunchInfo, backend: str | None = None) -> bool:
    """Under a launcher with several ranks and no live group, create it (the card set as current device
    first for nccl, quirks applied first, a finite timeout); True if this call created it."""
    global _created_by_us
    if info.world_size <= 1 or world.live_group() is not None:
        return False
    backend = backend or ("nccl" if wants_cuda() else "gloo")
    apply_quirks_here(info.local_world_size, backend)
    init_method = "env://"
    if info.launcher in ("slurm", "mpi"):
        if not info.master_addr:
            raise LauncherEnvError(
                f"{info.launcher} started {info.world_size} ranks but no MASTER_ADDR is known (SLURM_*NODELIST "
                f"and MASTER_ADDR are unset). Expected the address of rank 0's node; export MASTER_ADDR=<host> "
                f"(and MASTER_PORT) before launching."
            )
        init_method = f"tcp://{info.master_addr}:{info.master_port or 29500}"
    elif "TORCHELASTIC_USE_AGENT_STORE" not in os.environ:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise LauncherEnvError(
                    f"{info.launcher} set RANK={info.rank} and WORLD_SIZE={info.world_size} but not {name}. "
                    f"Expected MASTER_ADDR and MASTER_PORT naming rank 0's rendezvous; export {name}=... "
                    f"or launch with `torchrun`."
                )
    import torch
    import torch.distributed as td

    timeout = datetime.timedelta(seconds=float(os.environ.get("LEVERS9_PG_TIMEOUT", DEFAULT_TIMEOUT_S)))
    card = torch.device("cuda", cuda_index_for_local_rank(info.local_rank)) if backend == "nccl" else None
    td.init_process_group(backend, init_method=init_method, rank=info.rank, world_size=info.world_size,
                          timeout=timeout, device_id=card)  # fmt: skip
    _created_by_us = True
    return True


def ensure_group() -> None:
    """Make the group now if the launcher says there are several ranks and none exists (helpers call this)."""
    if world.live_group() is not None:
        return
    info = world.launch_info()
    if info.world_size <= 1:
        return
    with contextlib.nullcontext() if _stall_slot is None else _stall_slot.inside("init_process_group"):
        created = join_launcher_group(info, _lazy_backend)
    if created:
        atexit.register(destroy_own_group)


@contextlib.contextmanager
def lazy_group(backend: str, stall_slot: Any = None) -> Iterator[None]:
    """While the block runs fn: no group is made up front, but one with `backend` is made on first need (a
    levers9 helper, or a torch.distributed collective called with no group, as code written for an eager
    group does); fn's own `init_process_group` works as under torchrun. A group made in the block is
    destroyed at its end."""
    global _lazy_backend, _stall_slot
    route_env_rendezvous()
    _make_group_on_first_collective()
    had_group = world.live_group() is not None
    saved = _lazy_backend, _stall_slot
    _lazy_backend, _stall_slot = backend, stall_slot
    try:
        yield
    finally:
        _lazy_backend, _stall_slot = saved
        if not had_group:
            destroy_own_group()


def _make_group_on_first_collective() -> None:
    """Inside lazy_group, a collective called with no group makes it instead of failing with "Default
    process group has not been initialized". Installed once per process."""
    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    original = c10d._get_default_group  # what every collective called with group=None asks first
    if getattr(original, "__levers9_wrapped__", False):
        return

    def default_group() -> Any:
        if _lazy_backend is not None and not c10d.is_initialized():
            join_launcher_group(world.launch_info(), _lazy_backend)  # the collective asking is already counted as one
        return original()

    default_group.__levers9_wrapped__ = True  # type: ignore[attr-defined]
    c10d._get_default_group = default_group  # type: ignore[attr-defined]


def route_env_rendezvous() -> None:
    """Make `init_process_group(..., init_method="env://")` (the default) right in levers9's and torchrun's ranks.

    On a launcher's store (TORCHELASTIC_USE_AGENT_STORE=True: distributed.run's parent or torchrun's
    agent) every group after this process's first gets keys of its own, so a group made after fn
    destroyed its own never reads the old group's addresses. In a levers9 rank, a rank= or world_size=
    that contradicts the ranks started is refused at once instead of waiting for ranks that never come,
    and a MASTER_PORT the script set itself (as the PyTorch DDP tutorial does) gets torch's own env://
    rendezvous, in which rank 0 hosts the store. Installed once per process, in place of torch's handler.
    """
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    handlers = rendezvous._rendezvous_handlers  # torch offers no public way to replace a registered scheme
    original = handlers.get("env")
    if original is None or getattr(original, "__levers9_wrapped__", False):
        return

    def env_handler(url: str, **kwargs: Any) -> Any:
        in_levers9_rank = STORE_PORT_VAR in os.environ
        if in_levers9_rank and not _names_parent_store():
            _check_asked_world(url, ("world_size",))
            return _without_agent_store(original(url, **kwargs))
        if in_levers9_rank:
            _check_asked_world(url, ("world_size", "rank"))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return _fresh_keys(original(url, **kwargs))
        return original(url, **kwargs)

    env_handler.__levers9_wrapped__ = True  # type: ignore[attr-defined]
    handlers["env"] = env_handler


def _fresh_keys(inner: Any) -> Any:
    """The launcher's store, under a prefix of its own for each group after the first: every rank forms its
    groups in the same order, so the prefixes match (torch reuses the first group's keys otherwise)."""
    global _groups_formed
    import torch.distributed as td

    _groups_formed += 1
    number = _groups_formed
    for store, rank, world_size in inner:
        yield (store if number == 1 else td.PrefixStore(f"levers9-group-{number}/", store)), rank, world_size


def _names_parent_store() -> bool:
    """True while MASTER_ADDR/MASTER_PORT still name the store distributed.run's parent hosts."""
    port = os.environ.get(STORE_PORT_VAR)
    return os.environ.get("MASTER_PORT") == port and os.environ.get("MASTER_ADDR") in ("127.0.0.1", "localhost")


def _without_agent_store(inner: Any) -> Any:
    """Torch's env:// rendezvous with TORCHELASTIC_USE_AGENT_STORE off while it makes its store (rank 0 hosts it)."""
    saved = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        first = next(inner)
    finally:
        if saved is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved
    yield first
    yield from inner


def _check_asked_world(url: str, names: tuple[str, ...]) -> None:
    """ConfigError when init_process_group's rank= or world_size= contradicts the ranks distributed.run started."""
    query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
    started = {"world_size": os.environ.get("WORLD_SIZE"), "rank": os.environ.get("RANK")}
    for name in names:
        value, asked = started[name], query.get(name)
        if asked is not None and value is not None and asked != value:
            raise ConfigError(
                f"init_process_group({name}={asked}) on a rank that levers9 started as RANK={started['rank']} of "
                f"WORLD_SIZE={started['world_size']}: the group would wait for ranks that were never started. "
                f"Expected {name}={value}; drop the {name}= argument (env:// reads RANK and WORLD_SIZE), or "
                f"start as many ranks as the script asks for (`levers9 run --nproc-per-node {asked if name == 'world_size' else 'N'}`, "
                f"or nprocs= in distributed.run)."
            )
