"""The default process group's life: joined before fn, destroyed only by its maker.

`distributed.run` makes the group before fn on every path with more than one rank (or adopts a live one), so fn
starts with `torch.distributed.is_initialized()` True, through `init_process_group` as any script would call it. A
group the user, accelerate or a launcher made is never destroyed here. Under a launcher, levers9's helpers used
without `distributed.run` make the group at the first that needs one (helpers.py).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import os
import socket
import threading
import traceback
from collections.abc import Iterator
from typing import Any

from levers9 import runtime
from levers9.distributed import detect, devices, slurm_env
from levers9.distributed.detect import LaunchInfo
from levers9.errors import ConfigError, LauncherEnvError

DEFAULT_TIMEOUT_S = 600.0
# Set by distributed.run for its ranks: the loopback port of the rendezvous store the parent hosts.
STORE_PORT_VAR = "LEVERS9_STORE_PORT"
# Set by distributed.run for its ranks: an unguessable token that starts every key of the group levers9
# makes on that store. Any local user can connect to a TCP port, but one who cannot read the ranks'
# environment (/proc/<pid>/environ is the owner's alone) cannot name, so cannot set, a key they read.
STORE_SECRET_VAR = "LEVERS9_STORE_SECRET"


def destroy_own_group() -> None:
    """Destroy the default group if levers9 created it; leave anyone else's alone."""
    this = runtime.this_process()
    if not this.own_group:
        return
    this.own_group = False
    td = detect.live_group()
    if td is not None:
        # Let DDP models and pending work objects go first: gloo threads still holding them at
        # interpreter exit abort the process (pytorch/pytorch#190489, pytorch/pytorch#179291).
        gc.collect()
        td.destroy_process_group()


def pg_timeout() -> datetime.timedelta:
    """The finite timeout of a group levers9 makes: LEVERS9_PG_TIMEOUT seconds, else 600. ConfigError
    naming the variable when it is not a finite number of seconds above 0."""
    text = os.environ.get("LEVERS9_PG_TIMEOUT", "")
    if not text:
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(
            f"LEVERS9_PG_TIMEOUT={text!r}: expected a finite number of seconds above 0 for the process group's "
            f"timeout (e.g. export LEVERS9_PG_TIMEOUT=1800). Unset it for {DEFAULT_TIMEOUT_S:g} s."
        )
    return datetime.timedelta(seconds=seconds)


def join_launcher_group(info: LaunchInfo, backend: str | None = None) -> bool:
    """With several ranks and no live group, make it (the card set as current device first for nccl, a finite
    timeout); True if this call made it. The caller applied the quirks for its world first (quirks.plan_for_world).

    Where a launcher hosts the store (distributed.run's parent, torchrun's agent:
    TORCHELASTIC_USE_AGENT_STORE=True) the group meets on it under keys of its own, so it never reads the
    keys of a group made there before (torch reuses them after destroy_process_group, and gloo then
    connects to the old group's addresses), and a group fn makes there itself never reads levers9's;
    under distributed.run those keys start with the run's secret (STORE_SECRET_VAR).
    Elsewhere torch's env:// rendezvous (rank 0 hosts a fresh store), or tcp://MASTER under SLURM and MPI.
    """
    if info.world_size <= 1 or detect.live_group() is not None:
        return False
    if info.launcher == "slurm":
        slurm_env.check_tasks_match_cards(os.environ, info.local_world_size)
    backend = backend or devices.default_backend()
    import torch
    import torch.distributed as td

    kwargs: dict[str, Any] = {"rank": info.rank, "world_size": info.world_size, "timeout": pg_timeout()}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", devices.cuda_index_for_local_rank(info.local_rank))
    agent_store = _agent_store_address()
    if agent_store is not None:
        this = runtime.this_process()
        this.groups_made += 1
        store = td.TCPStore(agent_store[0], agent_store[1], None, False, kwargs["timeout"])
        secret = os.environ.get(STORE_SECRET_VAR)
        prefix = f"levers9-{secret}-group-{this.groups_made}/" if secret else f"levers9-group-{this.groups_made}/"
        td.init_process_group(backend, store=td.PrefixStore(prefix, store), **kwargs)
        _all_joined(store, prefix, info.world_size)
    else:
        td.init_process_group(backend, init_method=_init_method(info), **kwargs)
    runtime.this_process().own_group = True
    return True


def _all_joined(store: Any, prefix: str, world_size: int) -> None:
    """Wait until every rank's init_process_group has returned: a rank that made its connections first must not
    run ahead, end, and close them while a peer is still connecting (gloo's connectFullMesh then fails there)."""
    if store.add(f"{prefix}joined", 1) == world_size:
        store.set(f"{prefix}all-joined", b"1")
    store.wait([f"{prefix}all-joined"])


def _agent_store_address() -> tuple[str, int] | None:
    """(host, port) of the store the launcher hosts for its ranks, or None where rank 0 hosts one itself."""
    if STORE_PORT_VAR in os.environ:  # a rank of distributed.run (fn may have pointed MASTER_PORT elsewhere)
        return "127.0.0.1", int(os.environ[STORE_PORT_VAR])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in os.environ:
        return os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500"))
    return None


def _init_method(info: LaunchInfo) -> str:
    """Where a launcher's ranks meet: env:// under torchrun-style launchers, tcp://MASTER under SLURM and MPI."""
    if info.launcher in ("slurm", "mpi"):
        if not info.master_addr:
            raise LauncherEnvError(
                f"{info.launcher} started {info.world_size} ranks but no MASTER_ADDR is known (SLURM_*NODELIST "
                f"and MASTER_ADDR are unset). Expected the address of rank 0's node; export MASTER_ADDR=<host> "
                f"(and MASTER_PORT) before launching."
            )
        source = "MASTER_ADDR" if os.environ.get("MASTER_ADDR") else "the first node of SLURM_STEP_NODELIST/SLURM_JOB_NODELIST"
        check_resolves(info.master_addr, source)
        return f"tcp://{info.master_addr}:{info.master_port or 29500}"
    if "TORCHELASTIC_USE_AGENT_STORE" not in os.environ:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise LauncherEnvError(
                    f"{info.launcher} set RANK={info.rank} and WORLD_SIZE={info.world_size} but not {name}. "
                    f"Expected MASTER_ADDR and MASTER_PORT naming rank 0's rendezvous; export {name}=... "
                    f"or launch with `torchrun`."
                )
    if os.environ.get("MASTER_ADDR"):
        check_resolves(os.environ["MASTER_ADDR"], "MASTER_ADDR")
    return "env://"


@contextlib.contextmanager
def joined(backend: str, slot: Any = None) -> Iterator[None]:
    """The block runs in this rank's process group: the live one if there is one, else one made now (counted as a
    wait in `slot`, the rank's stall-board slot, while it forms); a group made here is destroyed at the end.

    A ValueError from the block that torch's `init_process_group` raised because this group already exists
    (fn is a classic torchrun main()) becomes a ConfigError naming `init_group=False`.
    """
    made = False
    if detect.live_group() is None:
        with contextlib.nullcontext() if slot is None else slot.inside("init_process_group"):
            made = join_launcher_group(detect.launch_info(), backend)
    try:
        yield
    except ValueError as exc:
        if _raised_by_second_init(exc):
            raise ConfigError(
                f"fn called torch.distributed.init_process_group on rank {detect.rank()}, but distributed.run had "
                f"already joined every rank into a process group before calling fn (torch: {exc}). Expected fn to use "
                f"the live group; drop fn's init_process_group/destroy_process_group calls, or pass "
                f"init_group=False to distributed.run so that fn makes its own group, or run the script unchanged "
                f"with distributed.run_script / `levers9 run` (torchrun's meaning), or distributed.spawn (mp.spawn's)."
            ) from exc
        raise
    finally:
        if made:
            destroy_own_group()


def _raised_by_second_init(exc: ValueError) -> bool:
    """True if torch's init_process_group raised `exc` because a default group already existed."""
    frames = traceback.extract_tb(exc.__traceback__)
    return (
        bool(frames)
        and frames[-1].name == "init_process_group"
        and frames[-1].filename.endswith("distributed_c10d.py")
        and detect.live_group() is not None
    )


RESOLVE_TIMEOUT_S = 10.0


def check_resolves(host: str, source: str, timeout: float = RESOLVE_TIMEOUT_S) -> None:
    """Return when `host` resolves to an address; LauncherEnvError naming `host` and `source` (the variable
    it came from) when it does not, or when the resolver gives no answer within `timeout` seconds: one error
    within seconds before a group is made, instead of every rank waiting until killed."""
    answer: list[BaseException | None] = []

    def resolve() -> None:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            answer.append(None)
        except OSError as exc:
            answer.append(exc)

    resolver = threading.Thread(target=resolve, name="levers9-resolve", daemon=True)  # getaddrinfo cannot be interrupted
    resolver.start()
    resolver.join(timeout)
    if answer and answer[0] is None:
        return
    seen = f"does not resolve ({answer[0]})" if answer else f"gave no answer from the resolver within {timeout:g} s"
    raise LauncherEnvError(
        f"The rendezvous host {host!r} (from {source}) {seen}, so the ranks could never meet. Expected a name or "
        f"address of rank 0's node that every node resolves: export MASTER_ADDR=<that node's address>, or add "
        f"the node's name to DNS or /etc/hosts."
    )
