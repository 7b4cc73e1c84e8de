"""Functions the SLURM tests run as jobs (module level, so a job imports them by name)."""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any

from levers9 import distributed as dist


def where(x: int) -> dict[str, Any]:
    """The cell's value and where SLURM ran it."""
    print(f"cell {x} on {os.environ.get('SLURMD_NODENAME')}", flush=True)
    return {"x": x, "node": os.environ.get("SLURMD_NODENAME"), "cards": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "array": os.environ.get("SLURM_ARRAY_JOB_ID"), "host": socket.gethostname()}  # fmt: skip


def square(x: int) -> int:
    return x * x


def _rank_report() -> dict[str, Any]:
    import torch
    import torch.distributed as td

    total = torch.tensor([float(dist.rank())])
    td.all_reduce(total)
    return {"rank": dist.rank(), "world": dist.world_size(), "node_rank": dist.node_rank(),
            "node": os.environ.get("SLURMD_NODENAME"), "sum": total.item(), "master_port": os.environ.get("MASTER_PORT")}  # fmt: skip


def train(_cfg: Any = None) -> dict[str, Any]:
    """A job that calls distributed.run, as the seed's @job(gpu_count=4) does: every rank's report, from rank 0."""
    import torch.distributed as td

    def one_rank() -> list[Any]:
        reports: list[Any] = [None] * dist.world_size()
        td.all_gather_object(reports, _rank_report())
        return reports

    return {"ranks": dist.run(one_rank)}


def fail_on_rank(bad_rank: int, how: str = "raise") -> int:
    """Raise (or die by SIGKILL) on `bad_rank` only; the others wait for it in a collective."""
    import torch
    import torch.distributed as td

    def one_rank() -> int:
        if dist.rank() == bad_rank and how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if dist.rank() == bad_rank:
            raise ValueError(f"rank {dist.rank()} failed on purpose")
        td.all_reduce(torch.zeros(1))
        return dist.rank()

    return dist.run(one_rank)


def train_restarting(folder: str) -> list[dict[str, Any]]:
    """Every rank's report of the attempt that returned: rank 0 saves a checkpoint in attempt 1, then rank 3 dies
    by SIGKILL while the others wait in a collective; attempt 2 resumes from the checkpoint."""
    from pathlib import Path

    import torch
    import torch.distributed as td

    def one_rank() -> list[Any]:
        attempt = dist.restart_count() + 1
        checkpoint = Path(folder) / "checkpoint"
        if attempt == 1 and dist.rank() == 0:
            checkpoint.write_text("step 5")
        td.barrier()
        if attempt == 1 and dist.rank() == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        total = torch.tensor([1.0])
        td.all_reduce(total)
        mine = {"rank": dist.rank(), "attempt": attempt, "sum": total.item(), "resumed": checkpoint.read_text(),
                "node": os.environ.get("SLURMD_NODENAME")}  # fmt: skip
        reports: list[Any] = [None] * dist.world_size()
        td.all_gather_object(reports, mine)
        return reports

    return dist.run(one_rank)


def sleep_then(seconds: float, marker: str = "") -> str:
    """Sleep; `marker`: a file written when the job starts (so a test waits for that, not for time)."""
    if marker:
        with open(marker, "w") as out:
            out.write(f"{os.getpid()} {os.environ.get('SLURM_JOB_ID')}\n")
    time.sleep(seconds)
    return "slept"



def save_on_sigterm(folder: str, seconds_to_save: float) -> str:
    """Wait to be stopped; on SIGTERM, save for `seconds_to_save` (longer than the cluster's KillWait of 5 s)
    and exit. Files in `folder`: started (when running), term (SIGTERM came), saved (the save finished)."""
    from pathlib import Path

    def on_term(_signum: int, _frame: Any) -> None:
        (Path(folder) / "term").write_text("got SIGTERM")
        time.sleep(seconds_to_save)
        (Path(folder) / "saved").write_text("saved")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    (Path(folder) / "started").write_text(str(os.getpid()))
    time.sleep(300)
    return "never stopped"


def save_at_time_limit(folder: str, seconds_to_save: float = 0) -> dict[str, Any]:
    """A long training that saves on SIGTERM: the first run computes until the time limit (its `started` file says
    it runs), takes `seconds_to_save` to save its checkpoint when SIGTERM comes, and exits; a later run resumes from it
    and returns (without a checkpoint: says so)."""
    from pathlib import Path

    from levers9 import current_job

    checkpoint = Path(folder) / "checkpoint"
    context = current_job()
    attempt = None if context is None else context.attempt
    if checkpoint.exists() or (attempt or 1) > 1:
        return {"attempt": attempt, "resumed": checkpoint.read_text() if checkpoint.exists() else "no checkpoint"}

    def on_term(_signum: int, _frame: Any) -> None:
        time.sleep(seconds_to_save)
        checkpoint.write_text("saved at the time limit")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    (Path(folder) / "started").write_text(os.environ.get("SLURM_JOB_ID", ""))
    deadline, total = time.monotonic() + 300, 0
    while time.monotonic() < deadline:  # computes, as training does, until the time limit's stop
        total += sum(i * i for i in range(10_000))
    return {"attempt": None, "resumed": "the time limit never came"}


def killed_by_usr2_when_requeued(folder: str) -> None:
    """The first run computes until SIGTERM, saves and exits; the next run (the job requeued) dies at once of SIGUSR2
    with no handler, as a run does that SLURM's early signal reaches before its handler is set."""
    from pathlib import Path

    from levers9 import current_job

    context = current_job()
    if (Path(folder) / "saved").exists() or (context is not None and context.attempt > 1):
        (Path(folder) / "second run").write_text("")
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGUSR2)

    def on_term(_signum: int, _frame: Any) -> None:
        (Path(folder) / "saved").write_text("")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    (Path(folder) / "ready").write_text("")
    deadline, total = time.monotonic() + 300, 0
    while time.monotonic() < deadline:  # computes, as training does, until the stop
        total += sum(i * i for i in range(10_000))


def ranks_resume_after_requeue(folder: str) -> dict[str, Any]:
    """distributed.run on the job's cards; each rank writes `ready-<rank>`, waits, and saves `saved-<rank>` on SIGTERM
    (after 2 s), then exits; in a later run, rank 0 returns the attempt and the checkpoints it found (none: at once)."""
    from pathlib import Path

    from levers9 import current_job

    def one_rank() -> dict[str, Any]:
        context = current_job()
        saved = sorted(p.name for p in Path(folder).glob("saved-*"))
        if saved or (context is not None and context.attempt > 1):
            return {"attempt": None if context is None else context.attempt, "saved": saved}

        def on_term(_signum: int, _frame: Any) -> None:
            time.sleep(2)
            (Path(folder) / f"saved-{dist.rank()}").write_text("saved")
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, on_term)
        (Path(folder) / f"ready-{dist.rank()}").write_text(str(os.getpid()))
        time.sleep(300)
        return {"attempt": None, "saved": "never stopped"}

    return dist.run(one_rank)


def crash_on_first_attempt() -> int:
    """Die by SIGKILL in attempt 1; return the attempt's number after that."""
    from levers9 import current_job

    context = current_job()
    attempt = 0 if context is None else context.attempt
    if attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return attempt


def resume_after_requeue(folder: str) -> dict[str, Any]:
    """A job that checkpoints: each run counts itself in `folder`/checkpoint, and the first run waits there
    to be requeued (its `started` file says it is running); a later run returns at once."""
    from pathlib import Path

    checkpoint = Path(folder) / "checkpoint"
    runs = int(checkpoint.read_text()) + 1 if checkpoint.exists() else 1
    checkpoint.write_text(str(runs))
    (Path(folder) / f"started-{runs}").write_text(os.environ.get("SLURM_JOB_ID", ""))
    if runs == 1:
        time.sleep(300)
    from levers9 import current_job

    context = current_job()
    return {"runs": runs, "restart_count": os.environ.get("SLURM_RESTART_COUNT"),
            "attempt": None if context is None else context.attempt}  # fmt: skip


def gated_square(x: int, folder: str) -> int:
    """Count this run in `folder`/runs-<x>, say it started (`folder`/started-<x>: pid, job id), compute until `folder`/gate
    exists, then return x * x (a negative x raises ValueError)."""
    with open(os.path.join(folder, f"runs-{x}"), "a") as runs:
        runs.write(f"{os.environ.get('SLURM_JOB_ID')}\n")
    array = os.environ.get("SLURM_ARRAY_JOB_ID")  # an array's task is cancelled as <array>_<task> (its own id: "invalid")
    job_id = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ.get("SLURM_JOB_ID")
    with open(os.path.join(folder, f"started-{x}"), "w") as started:
        started.write(f"{os.getpid()} {job_id}\n")
    total = 0
    while not os.path.exists(os.path.join(folder, "gate")):
        total += sum(range(10_000))  # a small step of work
    if x < 0:
        raise ValueError(f"x={x} is negative")
    return x * x


def ranks_compute_until_gate(folder: str) -> int:
    """Every rank says it started (`folder`/started-<rank>) and computes until `folder`/gate exists."""

    def one_rank() -> int:
        with open(os.path.join(folder, f"started-{dist.rank()}"), "w") as started:
            started.write(f"{os.getpid()} {os.environ.get('SLURMD_NODENAME')}\n")
        total = 0
        while not os.path.exists(os.path.join(folder, "gate")):
            total += sum(range(10_000))  # a small step of work
        return dist.rank()

    return dist.run(one_rank)[0]


def print_megabytes(megabytes: int) -> int:
    """Print `megabytes` MB of output (lines of 1 KB), then return the count."""
    line = "x" * 1023
    for _ in range(megabytes * 1024):
        print(line)
    return megabytes
