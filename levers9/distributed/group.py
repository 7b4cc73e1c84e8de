"""Creating, joining and destroying the default process group, with quirks applied first.

levers9 destroys only a group it created itself; a group the user, accelerate or a launcher made is
left alone.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
from typing import Any

from levers9.distributed import world
from levers9.distributed.detect import LaunchInfo
from levers9.errors import DeviceError, LauncherEnvError

log = logging.getLogger("levers9.distributed")

DEFAULT_TIMEOUT_S = 600.0
_created_by_us = False
_cpu_only = False


def compute_on_cpu() -> None:
    """Make this process compute on the CPU even where CUDA is present (ranks of a gloo run on simulated cards)."""
    global _cpu_only
    _cpu_only = True


def cpu_only() -> bool:
    """True once compute_on_cpu() was called in this process."""
    return _cpu_only


def wants_cuda() -> bool:
    """True if this process should compute on a card (CUDA present and not forced onto the CPU)."""
    if _cpu_only:
        return False
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
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

    quirks.apply_quirks(
        local_world_size=local_world_size, backend=backend, is_main=world.rank() == 0, disabled=disabled
    )


def join_launcher_group(info: LaunchInfo, *, backend: str | None = None, disabled: tuple[str, ...] = ()) -> bool:
    """Under a launcher with several ranks and no live group, create it (the card set as current device
    first for nccl, quirks applied first, a finite timeout) and remember that levers9 owns it; True if
    this call created it."""
    global _created_by_us
    if info.world_size <= 1 or world.live_group() is not None:
        return False
    backend = backend or ("nccl" if wants_cuda() else "gloo")
    apply_quirks_here(info.local_world_size, backend, disabled)
    if info.launcher in ("slurm", "mpi"):
        if not info.master_addr:
            raise LauncherEnvError(
                f"{info.launcher} started {info.world_size} ranks but no MASTER_ADDR is known (SLURM_*NODELIST "
                f"and MASTER_ADDR are unset). Expected the address of rank 0's node; export MASTER_ADDR=<host> "
                f"(and MASTER_PORT) before launching."
            )
        init_method = f"tcp://{info.master_addr}:{info.master_port or 29500}"
    else:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ:
                raise LauncherEnvError(
                    f"{info.launcher} set RANK={info.rank} and WORLD_SIZE={info.world_size} but not {name}. "
                    f"Expected MASTER_ADDR and MASTER_PORT naming rank 0's rendezvous; export {name}=... "
                    f"or launch with `torchrun`."
                )
        init_method = "env://"
    import torch
    import torch.distributed as td

    timeout = datetime.timedelta(seconds=float(os.environ.get("LEVERS9_PG_TIMEOUT", DEFAULT_TIMEOUT_S)))
    card = torch.device("cuda", cuda_index_for_local_rank(info.local_rank)) if backend == "nccl" else None
    td.init_process_group(backend, init_method=init_method, rank=info.rank, world_size=info.world_size,
                          timeout=timeout, device_id=card)  # fmt: skip
    _created_by_us = True
    return True


# In a rank of distributed.run: its stall slot, so that waiting for the other ranks to form the group
# counts as waiting in a collective (a rank that never arrives is then reported as a stall).
_stall_slot: Any = None


def ensure_group() -> None:
    """Make sure a group exists when the launcher says there are several ranks (helpers call this lazily)."""
    if world.live_group() is not None:
        return
    info = world.launch_info()
    if info.world_size <= 1:
        return
    slot = _stall_slot
    if slot is not None:
        slot.enter("init_process_group")
    try:
        created = join_launcher_group(info)
    finally:
        if slot is not None:
            slot.leave("init_process_group")
    if created:
        atexit.register(destroy_own_group)


# Set by distributed.run for its ranks: the loopback port of the rendezvous store the parent hosts.
STORE_PORT_VAR = "LEVERS9_STORE_PORT"


def prepare_lazy_group(stall_slot: Any = None) -> None:
    """In a rank of distributed.run, before fn: no group yet, but one is made whenever it is first needed.

    fn may make it (`init_process_group`, see route_env_rendezvous); levers9's helpers make it through
    ensure_group; and a torch.distributed collective called with no group (code written for levers9's
    former eager group) makes it too, instead of failing with "Default process group has not been
    initialized". Only a group made here is destroyed by levers9.
    """
    global _stall_slot
    _stall_slot = stall_slot
    route_env_rendezvous()
    import importlib

    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    original = c10d._get_default_group  # what every collective called with group=None asks first
    if getattr(original, "__levers9_wrapped__", False):
        return

    def default_group() -> Any:
        if not c10d.is_initialized() and STORE_PORT_VAR in os.environ:
            join_launcher_group(world.launch_info())  # the collective asking is already counted as one
        return original()

    default_group.__levers9_wrapped__ = True  # type: ignore[attr-defined]
    c10d._get_default_group = default_group  # type: ignore[attr-defined]


def route_env_rendezvous() -> None:
    """Make `init_process_group(..., init_method="env://")` (the default) right inside a levers9 rank.

    MASTER_PORT naming the parent's store: every rank, rank 0 included, joins it as a client (torch's
    TORCHELASTIC_USE_AGENT_STORE rule), and a rank/world_size argument that contradicts the ranks
    started is refused at once instead of waiting for ranks that never come. Any other MASTER_PORT (a
    script that sets its own, as the PyTorch DDP tutorial does): torch's own env:// rendezvous, in
    which rank 0 hosts the store. Installed once per process, in place of torch's "env" handler.
    """
    import importlib

    rendezvous = importlib.import_module("torch.distributed.rendezvous")

    handlers = rendezvous._rendezvous_handlers  # torch offers no public way to replace a registered scheme
    original = handlers.get("env")
    if original is None or getattr(original, "__levers9_wrapped__", False):
        return

    def env_handler(url: str, **kwargs: Any) -> Any:
        if STORE_PORT_VAR not in os.environ:  # not (or no longer) inside a levers9 run
            return original(url, **kwargs)
        if _names_parent_store():
            _check_asked_world(url, ("world_size", "rank"))
            return _fresh_keys(original(url, **kwargs))
        _check_asked_world(url, ("world_size",))
        return _without_agent_store(original(url, **kwargs))

    env_handler.__levers9_wrapped__ = True  # type: ignore[attr-defined]
    handlers["env"] = env_handler


_rendezvous_count = 0


def _fresh_keys(inner: Any) -> Any:
    """The parent store, under a prefix of its own for each group this rank forms on it: a group made after
    the user destroyed theirs must not read the first group's addresses (every rank forms its groups in
    the same order, so the prefixes match)."""
    global _rendezvous_count
    import torch.distributed as td

    _rendezvous_count += 1
    number = _rendezvous_count
    for store, rank, world_size in inner:
        yield (store if number == 1 else td.PrefixStore(f"levers9-group-{number}/", store)), rank, world_size


def _names_parent_store() -> bool:
    """True while MASTER_ADDR/MASTER_PORT still name the store distributed.run's parent hosts."""
    port = os.environ.get(STORE_PORT_VAR)
    return (
        port is not None
        and os.environ.get("MASTER_PORT") == port
        and os.environ.get("MASTER_ADDR") in ("127.0.0.1", "localhost")
    )


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
    from urllib.parse import parse_qs, urlparse

    from levers9.errors import ConfigError

    query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
    started = {"world_size": os.environ.get("WORLD_SIZE"), "rank": os.environ.get("RANK")}
    for name in names:
        value = started[name]
        asked = query.get(name)
        if asked is not None and value is not None and asked != value:
            raise ConfigError(
                f"init_process_group({name}={asked}) on a rank that levers9 started as RANK={started['rank']} of "
                f"WORLD_SIZE={started['world_size']}: the group would wait for ranks that were never started. "
                f"Expected {name}={value}; drop the {name}= argument (env:// reads RANK and WORLD_SIZE), or "
                f"start as many ranks as the script asks for (`levers9 run --nproc-per-node {asked if name == 'world_size' else 'N'}`, "
                f"or nprocs= in distributed.run)."
            )
