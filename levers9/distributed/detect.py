"""Which launcher started this process, and the rank layout it gave us.

Detection is a table of small detectors, each a function over an environment mapping (so tests pass a
dict and never touch os.environ). `detect(env)` tries them in `DETECTORS` order; the first that claims
the environment answers, and a world of one answers when none does.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Callable, Mapping
from types import ModuleType

import hostlist

from levers9.distributed import slurm_env
from levers9.errors import LauncherEnvError

# levers9's ranks carry torchrun's TORCHELASTIC_RUN_ID too (scripts test it); this prefix tells them apart.
LEVERS9_RUN_ID_PREFIX = "levers9-"

@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """The rank layout a launcher gave this process."""

    launcher: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None


SINGLE = LaunchInfo("single")


def _int(env: Mapping[str, str], name: str, launcher: str, default: int | None = None) -> int:
    """env[name] as an int (`default` when it is unset and one is given), or a LauncherEnvError naming the
    variable and its value."""
    if default is not None and name not in env:
        return default
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise LauncherEnvError(
            f"{name}={value!r} is set (by {launcher}?) but is not an integer. Expected a whole number; "
            f"unset {name} or set it to one."
        ) from None


def _require(env: Mapping[str, str], names: tuple[str, ...], launcher: str, marker: str) -> None:
    """Raise if any of `names` is missing although `marker` says `launcher` started us."""
    missing = [name for name in names if name not in env]
    if missing:
        present = ", ".join(f"{n}={env[n]}" for n in names if n in env) or "none of them"
        raise LauncherEnvError(
            f"{marker} says {launcher} started this process, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set (set: {present}). Expected all of "
            f"{', '.join(names)}; launch with `{launcher}` itself, or set the missing variables."
        )


def _port(env: Mapping[str, str], launcher: str) -> int | None:
    return _int(env, "MASTER_PORT", launcher) if "MASTER_PORT" in env else None


def _torchrun_layout(env: Mapping[str, str], launcher: str, marker: str) -> LaunchInfo:
    """The RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK layout torchrun sets."""
    _require(env, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"), launcher, marker)
    node = "GROUP_RANK" if "GROUP_RANK" in env else "NODE_RANK"
    rank, world, local_rank, local_world = (_int(env, n, launcher) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    return LaunchInfo(launcher, rank, world, local_rank, local_world, _int(env, node, launcher, 0), env.get("MASTER_ADDR"),
                      _port(env, launcher))  # fmt: skip


def detect_accelerate(env: Mapping[str, str]) -> LaunchInfo | None:
    """`accelerate launch`: ACCELERATE_* markers; torchrun's layout with several processes, else a world of one."""
    marker = next((m for m in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND") if m in env), None)
    if marker is None:
        return None
    if "TORCHELASTIC_RUN_ID" in env or "RANK" in env:
        return _torchrun_layout(env, "accelerate", marker)
    return LaunchInfo("accelerate")


def detect_torchrun(env: Mapping[str, str]) -> LaunchInfo | None:
    """torchrun (torch.distributed.run / elastic agent): TORCHELASTIC_RUN_ID, unless it is a levers9 rank's."""
    if "TORCHELASTIC_RUN_ID" not in env or detect_levers9(env) is not None:
        return None
    return _torchrun_layout(env, "torchrun", "TORCHELASTIC_RUN_ID")


def detect_levers9(env: Mapping[str, str]) -> LaunchInfo | None:
    """A rank started by levers9's own distributed.run or job runner: LEVERS9_LAUNCHER=levers9 (and, when
    TORCHELASTIC_RUN_ID is set, a levers9 run id: torchrun started inside a levers9 rank is torchrun)."""
    if env.get("LEVERS9_LAUNCHER") != "levers9":
        return None
    if not env.get("TORCHELASTIC_RUN_ID", LEVERS9_RUN_ID_PREFIX).startswith(LEVERS9_RUN_ID_PREFIX):
        return None
    return _torchrun_layout(env, "levers9", "LEVERS9_LAUNCHER=levers9")


def expand_nodelist(nodelist: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """SLURM's compressed host list (`gpu[01-04,07],cpu1`, `gpu[1-2]-ib`) as host names, in order."""
    try:
        return list(hostlist.expand_hostlist(nodelist))
    except hostlist.BadHostlist as exc:
        raise LauncherEnvError(
            f"{variable}={nodelist!r} is not a SLURM host list ({exc}). Expected names such as gpu[01-04,07]; "
            "launch with srun, or set MASTER_ADDR to the first node's name."
        ) from None


def _tasks_on_node(spec: str, node: int) -> int:
    """Tasks on node `node` from SLURM's `2(x3),1` notation."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match:
            counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts[node] if node < len(counts) else 1


def detect_slurm(env: Mapping[str, str]) -> LaunchInfo | None:
    """A task of several started by `srun`: SLURM_PROCID with a job step (SLURM_STEP_ID). An sbatch script itself
    is not a rank, and neither is a step of one task: it is a world of one that may start its own ranks."""
    if "SLURM_PROCID" not in env or slurm_env.step_id(env) is None:
        return None
    size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    _require(env, (size_var, "SLURM_LOCALID"), "slurm", "SLURM_PROCID")
    if env[size_var].strip() == "1":
        return None  # one task (`srun -n1`, a submitted job): as on a workstation, distributed.run starts a rank per card
    node = _int(env, "SLURM_NODEID", "slurm", 0)
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    variable = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    nodelist = env.get(variable, "")
    hosts = expand_nodelist(nodelist, variable) if nodelist and not env.get("MASTER_ADDR") else []
    port = _port(env, "slurm")
    return LaunchInfo("slurm", _int(env, "SLURM_PROCID", "slurm"), _int(env, size_var, "slurm"), _int(env, "SLURM_LOCALID", "slurm"),
                      _tasks_on_node(per_node, node), node, env.get("MASTER_ADDR") or (hosts[0] if hosts else None),
                      (slurm_env.master_port(env) or 29500) if port is None else port)  # fmt: skip


def detect_mpi(env: Mapping[str, str]) -> LaunchInfo | None:
    """Open MPI (OMPI_COMM_WORLD_*) or MPICH / Intel MPI (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID)."""
    if "OMPI_COMM_WORLD_RANK" in env:
        names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
        node_var = "OMPI_COMM_WORLD_NODE_RANK"
    elif "PMI_RANK" in env:
        local = "MPI_LOCALRANKID" if "MPI_LOCALRANKID" in env else "PMI_LOCAL_RANK"
        local_size = "MPI_LOCALNRANKS" if "MPI_LOCALNRANKS" in env else "PMI_LOCAL_SIZE"
        names = ("PMI_RANK", "PMI_SIZE", local, local_size)
        node_var = ""
    else:
        return None
    _require(env, names, "mpi", names[0])
    rank, world, local_rank, local_world = (_int(env, n, "mpi") for n in names)
    node = _int(env, node_var, "mpi", rank // max(local_world, 1))
    return LaunchInfo("mpi", rank, world, local_rank, local_world, node, env.get("MASTER_ADDR"), _port(env, "mpi"))


def detect_env(env: Mapping[str, str]) -> LaunchInfo | None:
    """RANK and WORLD_SIZE set by hand or by an operator (Kubeflow); LOCAL_* default to one process per node."""
    present = [n for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE") if n in env]
    if not present:
        return None
    missing = [n for n in ("RANK", "WORLD_SIZE") if n not in env]
    if missing:
        raise LauncherEnvError(
            f"{', '.join(f'{n}={env[n]}' for n in present)} {'is' if len(present) == 1 else 'are'} set but "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not. Expected RANK and WORLD_SIZE "
            f"together (as torchrun sets them); launch with `torchrun --nproc-per-node N script.py`, or unset "
            f"{', '.join(present)} to run as a world of one."
        )
    rank, world = _int(env, "RANK", "env"), _int(env, "WORLD_SIZE", "env")
    # Without LOCAL_WORLD_SIZE: one process per node (Kubeflow), or one node when LOCAL_RANK is given.
    local_world = _int(env, "LOCAL_WORLD_SIZE", "env", world if "LOCAL_RANK" in env else 1)
    node = _int(env, next((n for n in ("GROUP_RANK", "NODE_RANK") if n in env), ""), "env", rank // max(local_world, 1))
    return LaunchInfo("env", rank, world, _int(env, "LOCAL_RANK", "env", 0), local_world, node, env.get("MASTER_ADDR"),
                      _port(env, "env"))  # fmt: skip


# Tried in this order; the first detector that returns a LaunchInfo wins.
# - accelerate before torchrun: `accelerate launch` runs torchrun's agent underneath, so torchrun's
#   TORCHELASTIC_RUN_ID is present under accelerate too; only the ACCELERATE_* markers tell them apart.
# - torchrun before slurm and mpi: torchrun is often started by srun or mpirun, and then its own
#   RANK / LOCAL_RANK are the truth for this process, not the SLURM / MPI task ids of the agent.
# - levers9 before slurm/mpi for the same reason: our ranks may run inside an srun task.
# - env last: RANK / WORLD_SIZE alone are what every launcher above also sets.
DETECTORS: tuple[Callable[[Mapping[str, str]], LaunchInfo | None], ...] = (
    detect_accelerate,
    detect_torchrun,
    detect_levers9,
    detect_slurm,
    detect_mpi,
    detect_env,
)


def detect(env: Mapping[str, str]) -> LaunchInfo:
    """The launch layout `env` describes, validated; a world of one when nothing launched us."""
    for detector in DETECTORS:
        info = detector(env)
        if info is not None:
            _validate(info)
            return info
    return SINGLE


def _validate(info: LaunchInfo) -> None:
    """Raise LauncherEnvError if the numbers contradict each other."""
    world, local_world = f"WORLD_SIZE={info.world_size}", f"LOCAL_WORLD_SIZE={info.local_world_size}"
    for holds, seen, expected in (
        (info.world_size >= 1, world, "WORLD_SIZE >= 1"),
        (0 <= info.rank < info.world_size, f"RANK={info.rank} with {world}", "0 <= RANK < WORLD_SIZE"),
        (1 <= info.local_world_size <= info.world_size, f"{local_world} with {world}", "1 <= LOCAL_WORLD_SIZE <= WORLD_SIZE"),
        (0 <= info.local_rank < info.local_world_size, f"LOCAL_RANK={info.local_rank} with {local_world}",
         "0 <= LOCAL_RANK < LOCAL_WORLD_SIZE"),
    ):  # fmt: skip
        if not holds:
            raise LauncherEnvError(
                f"{seen} (from {info.launcher}); expected {expected}. Fix the launcher's rank and world size "
                f"settings, or unset these variables to run as a world of one."
            )


# The one place that decides this process's place in the world: a live default process group first (also one the
# user or accelerate made), then the launcher's environment, then a world of one. Cheap enough for a hot loop: the
# environment is parsed again only when one of these variables changes, and the group is asked directly.
_FINGERPRINT_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND", "LEVERS9_LAUNCHER",
    "SLURM_PROCID", "SLURM_STEP_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
)  # fmt: skip
_cache: tuple[tuple[object, ...], LaunchInfo] | None = None  # process-wide, as the environment is

# os.environ keeps its raw mapping in `_data` (bytes keys on POSIX); reading that with pre-encoded keys
# costs a fraction of os.environ.get, which matters when a helper runs every training step.
_RAW_ENV = os.environ._data  # type: ignore[attr-defined]
_RAW_KEYS = tuple(os.environ.encodekey(name) for name in _FINGERPRINT_VARS)


def launch_info() -> LaunchInfo:
    """What the launcher's environment says (validated), re-read only when a launcher variable changes."""
    global _cache
    key = tuple(map(_RAW_ENV.get, _RAW_KEYS))
    cached = _cache
    if cached is not None and cached[0] == key:
        return cached[1]
    info = detect(os.environ)
    _cache = (key, info)
    return info


def live_group() -> ModuleType | None:
    """torch.distributed if a default process group exists in this process, else None (never imports torch)."""
    td = sys.modules.get("torch.distributed")
    if td is None or not td.is_available() or not td.is_initialized():
        return None
    return td


def rank() -> int:
    """This process's global rank."""
    td = live_group()
    return int(td.get_rank()) if td is not None else launch_info().rank


def world_size() -> int:
    """How many ranks the world has."""
    td = live_group()
    return int(td.get_world_size()) if td is not None else launch_info().world_size


def local_rank() -> int:
    """This process's rank on its node; with a hand-made group and no launcher, its global rank (one node)."""
    info = launch_info()
    return rank() if info.launcher == "single" else info.local_rank


def local_world_size() -> int:
    """How many ranks run on this node; with a hand-made group and no launcher, the whole world (one node)."""
    info = launch_info()
    return world_size() if info.launcher == "single" else info.local_world_size


def node_rank() -> int:
    """Which node this is, counting from 0."""
    return launch_info().node_rank


def is_main() -> bool:
    """True on global rank 0 only."""
    return rank() == 0


def launcher() -> str:
    """Which launcher started this process: torchrun, accelerate, levers9, slurm, mpi, env or single."""
    return launch_info().launcher


def restart_count() -> int:
    """0 on a run's first attempt, then 1, 2, ... after each restart.

    Reads TORCHELASTIC_RESTART_COUNT, which distributed.run's `max_restarts=` and
    `torchrun --max-restarts` both set in every rank.

    Raises:
        LauncherEnvError: TORCHELASTIC_RESTART_COUNT is set but not a whole number.
    """
    text = os.environ.get("TORCHELASTIC_RESTART_COUNT", "").strip()
    if not text:
        return 0
    if not text.isdigit():
        raise LauncherEnvError(
            f"TORCHELASTIC_RESTART_COUNT={text!r}; expected a whole number >= 0 (the launcher's restart count). "
            f"Unset it, or let torchrun or distributed.run set it."
        )
    return int(text)
