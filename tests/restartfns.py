"""Importable functions the restart tests run on every rank (and inside jobs): real training-loop shapes
that resume from their own checkpoint, and ranks that fail differently on each attempt."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from levers9 import distributed as dist
from levers9.runtime import current_job

STEPS = 6
DIE_AFTER_STEP = 2


class AttemptError(Exception):
    """A user error of the test's own, raised with the attempt in its message."""


def record_attempt(folder: str) -> None:
    """Write what this rank sees of its attempt to attempt-<count>-rank-<rank>.json in `folder`."""
    seen = {
        "restart_count": dist.restart_count(),
        "env_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
        "env_max": os.environ.get("TORCHELASTIC_MAX_RESTARTS"),
        "launcher": dist.launcher(),
        "pid": os.getpid(),
    }
    path = Path(folder) / f"attempt-{dist.restart_count()}-rank-{dist.rank()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(seen))
    tmp.rename(path)
    # Every rank's record is written before any rank goes on (a rank that kills itself next would otherwise
    # end the attempt before a slower rank wrote its own, as on a loaded machine): a barrier on files.
    others = [path.with_name(f"attempt-{dist.restart_count()}-rank-{r}.json") for r in range(dist.world_size())]
    deadline = time.monotonic() + 60
    while not all(other.exists() for other in others):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank recorded attempt {dist.restart_count()} in 60 s: {others}")
        time.sleep(0.01)


def train_with_checkpoints(folder: str) -> dict[str, Any]:
    """Six steps, rank 0 checkpointing after each; rank 1 SIGKILLs itself after step 2 on the first attempt."""
    record_attempt(folder)
    ckpt = Path(folder) / "ckpt.pt"
    state = torch.load(ckpt) if ckpt.exists() else {"step": -1, "total": 0.0}
    resumed_from = state["step"] + 1
    total = state["total"]
    for step in range(resumed_from, STEPS):
        total += dist.all_reduce_mean(float(step + dist.rank())).item()
        if dist.is_main():
            torch.save({"step": step, "total": total}, ckpt)
        dist.barrier()
        if step == DIE_AFTER_STEP and dist.restart_count() == 0 and dist.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    return {"resumed_from": resumed_from, "total": total, "restart_count": dist.restart_count()}


def job_trains_with_checkpoints(folder: str) -> dict[str, Any]:
    """A job function: distributed.run with no restart argument (the job's max_restarts applies)."""
    result = dist.run(train_with_checkpoints, folder)
    job = current_job()
    return {**result, "job_attempt": job.attempt if job is not None else None}


def key_error_on_rank_1(folder: str) -> None:
    """Rank 1's own code raises KeyError at step 0; rank 0 waits for it in a barrier."""
    record_attempt(folder)
    if dist.rank() == 1:
        _ = {}["learning_rate"]
    dist.barrier()


def stall_on_first_attempt(folder: str) -> int:
    """On the first attempt rank 1 sleeps before an all_reduce rank 0 waits in; later attempts finish."""
    record_attempt(folder)
    if dist.restart_count() == 0 and dist.rank() == 1:
        time.sleep(120)
    dist.all_reduce_mean(1.0)
    return dist.restart_count()


def crash_stall_crash(folder: str) -> None:
    """Rank 1 fails on every attempt: SIGKILL, then a stall, then SIGKILL again."""
    record_attempt(folder)
    if dist.rank() == 1:
        if dist.restart_count() == 1:
            time.sleep(120)
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce_mean(1.0)


def raise_on_rank_1_every_attempt(folder: str) -> None:
    """Rank 1 raises AttemptError naming the attempt, every time."""
    record_attempt(folder)
    if dist.rank() == 1:
        raise AttemptError(f"bad batch on attempt {dist.restart_count()}")
    dist.barrier()


def killed_once_alone(folder: str) -> int:
    """A world of one that SIGKILLs itself on its first attempt (in place, that would kill the caller)."""
    record_attempt(folder)
    if dist.restart_count() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return dist.restart_count()


def always_killed_on_rank_1(folder: str) -> None:
    """Rank 1 SIGKILLs itself on every attempt."""
    record_attempt(folder)
    if dist.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def rank_1_vanishes_on_first_attempt(folder: str) -> int:
    """On the first attempt rank 1 leaves without a word (exit code 0), mid-run, while rank 0 waits for it in an
    all_reduce of the group both had formed."""
    record_attempt(folder)
    dist.barrier()  # the group is formed (lazily, by this first collective) before anyone leaves
    if dist.restart_count() == 0 and dist.rank() == 1:
        os._exit(0)
    dist.all_reduce_mean(1.0)
    return dist.restart_count()
