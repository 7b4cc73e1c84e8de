"""The one place that decides this process's place in the world.

A live default process group answers first (also one the user or accelerate created), then the
launcher's environment, then a world of one. Every answer is cheap enough for a hot loop: the
environment is parsed once per distinct set of launcher variables, and the group is asked directly.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

from levers9.distributed.detect import LaunchInfo, detect
from levers9.errors import LauncherEnvError

# The variables whose values decide detection's answer; when none changes, the cached answer stands.
_FINGERPRINT_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND", "LEVERS9_LAUNCHER",
    "SLURM_PROCID", "SLURM_STEP_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
)  # fmt: skip
# Process-wide, as the environment it is read from is: the last answer, kept while those variables are unchanged
# (rank() and world_size() run in hot loops).
_cache: tuple[tuple[object, ...], LaunchInfo] | None = None

# os.environ keeps its raw mapping in `_data` (bytes keys on POSIX); reading that with pre-encoded keys
# costs a fraction of os.environ.get, which matters when a helper runs every training step.
_RAW_ENV = os.environ._data  # type: ignore[attr-defined]
_RAW_KEYS = tuple(os.environ.encodekey(name) for name in _FINGERPRINT_VARS)


def _fingerprint() -> tuple[object, ...]:
    raw = _RAW_ENV
    return tuple(raw.get(key) for key in _RAW_KEYS)


def launch_info() -> LaunchInfo:
    """What the launcher's environment says (validated), re-read only when a launcher variable changes."""
    global _cache
    key = _fingerprint()
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
