"""A SLURM job left running after its caller exited, and its result collected later.

    @job(gpu_count=8, backend="slurm", slurm={"detach": True})
    def train(cfg): ...

    train.spawn(cfg)                      # the caller may exit, or be killed: the job keeps running
    $ levers9 runs result last            # waits for the job; prints each cell's value, or its error
    slurm_collect.result("last", cell=0)  # in Python: the value, or the job's own exception

`detach` is an explicit choice: without it, the reaper stops a caller's jobs when the caller is gone.
A detached job is still stopped by an explicit cancel (Ctrl-C of a caller that waits on it, leaving a
map early, a future's cancel). The backend records each cell's latest SLURM job id in the run's
`slurm/jobs.json` when it submits it; the result is how the job's task 0 ended (its TaskEnded in submitit's result file),
read once squeue no longer shows the job running.

A detached run's folder says so (`slurm/detached`), and its jobs store their own value where resume
looks (`results/<cell key>.pkl`, written by the job's task 0, as the caller's record does): a resume finds
a finished detached cell and does not submit it again, whether or not its caller lived to see it end.
Once the caller is gone, `levers9 runs` and `levers9 runs show` read each cell's state from SLURM
(`detached_cells`): pending, running, done (with its value) or failed, as `levers9 runs result` does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from levers9.errors import Levers9Error
from levers9.launch import outcomes, run_reader
from levers9.procs.failure import unship_value

JOBS_FILE = "jobs.json"
DETACHED_FILE = "detached"  # in a run's slurm/ folder: its jobs outlive their caller
# the states of a job SLURM is done with (squeue's %T)
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
                   "DEADLINE", "SPECIAL_EXIT", "REVOKED"})  # fmt: skip
VALUE_CHARS = 200  # of a value's repr shown by `levers9 runs show`
POLL_S = 1.0
_lock = threading.Lock()


def record(folder: Path, index: int, job_id: str) -> None:
    """Note that cell `index`'s latest attempt is SLURM job `job_id` (in `folder`/jobs.json, replaced whole)."""
    path = folder / JOBS_FILE
    with _lock:
        jobs: dict[str, str] = {}
        with contextlib.suppress(OSError, ValueError):
            jobs = json.loads(path.read_text())
        jobs[str(index)] = job_id
        fresh = path.with_name(f".{JOBS_FILE}.{os.getpid()}")
        fresh.write_text(json.dumps(jobs))
        os.replace(fresh, path)


def mark_detached(folder: Path) -> None:
    """Note in `folder` (a run's slurm/) that its jobs outlive their caller."""
    (folder / DETACHED_FILE).write_bytes(b"")


def is_detached(run_path: Path) -> bool:
    """True if the run in `run_path` submitted detached SLURM jobs."""
    return (run_path / "slurm" / DETACHED_FILE).is_file()


def queue_states(job_ids: list[str] | None = None) -> dict[str, tuple[str, str, str]] | None:
    """job id ('123', '123_4' for array elements) -> (state, reason, nodes) as squeue shows them, of `job_ids`, else
    of every job of this user; None when squeue gives no answer (then nothing is concluded from a job's absence).
    levers9's one reader of squeue (reaper.py, a script that imports nothing of levers9's, keeps its own)."""
    which = ["-u", str(os.getuid())] if job_ids is None else ["-j", ",".join(job_ids)]
    try:
        done = subprocess.run(["squeue", "-h", "-r", "-t", "all", *which, "-o", "%i|%T|%r|%N"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        if not job_ids:
            return None
        if len(job_ids) == 1:  # squeue refuses ids it no longer knows: one at a time, then
            return {} if "Invalid job id" in done.stderr else None
        states: dict[str, tuple[str, str, str]] = {}
        for job_id in job_ids:
            one = queue_states([job_id])
            if one is None:
                return None
            states.update(one)
        return states
    shown = (line.split("|") for line in done.stdout.splitlines())
    return {parts[0]: (parts[1], parts[2], parts[3]) for parts in shown if len(parts) == 4}


def _running(job_id: str) -> bool:
    states = queue_states([job_id])
    return states is not None and states.get(job_id, ("COMPLETED", "", ""))[0] not in ENDED


def _jobs(folder: Path) -> dict[str, str]:
    """cell index (as text) -> the SLURM job id of its latest attempt, from `folder`/jobs.json ({} if none)."""
    try:
        jobs = json.loads((folder / JOBS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in jobs.items()} if isinstance(jobs, dict) else {}


def _report(folder: Path, job_id: str) -> Any:
    """How task 0 of `job_id` ended, its TaskEnded (None if it has not written one, or it cannot be read)."""
    from submitit.core import utils as submitit_utils  # here: `levers9 runs` itself needs no submitit

    from levers9.launch.job_process import TaskEnded

    path = folder / f"{job_id}_0_result.pkl"
    if not path.exists():
        return None
    with contextlib.suppress(Exception):
        status, value = submitit_utils.pickle_load(path)
        if status == "success" and isinstance(value, TaskEnded):
            return value
    return None


def detached_cells(run: run_reader.Run) -> list[run_reader.CellState] | None:
    """The cells of `run` with what SLURM says of each one's job, if it is a detached run whose caller is gone
    (else None: its record says it all): pending, running, done (its value in `value`) or failed (`error` says
    how). A cell without a job keeps its recorded state; squeue without an answer leaves a cell without a
    report as its record has it."""
    if run.ended is not None or run.alive or not is_detached(run.path):
        return None
    cells = {cell.index: cell for cell in run.cells()}
    folder = run.path / "slurm"
    jobs = {int(i): job for i, job in _jobs(folder).items() if i.isdigit() and int(i) in cells}
    shown = queue_states(sorted(set(jobs.values()))) if jobs else {}
    states = None if shown is None else {job_id: state for job_id, (state, _, _) in shown.items()}
    for index, job_id in jobs.items():
        cell = cells[index]
        ended = _report(folder, job_id)
        report = None if ended is None else ended.outcome
        if report is not None and report.failure is None:
            cell.state, cell.error = "done", ""
            with contextlib.suppress(Exception):
                cell.value = repr(unship_value(report.value, f"the return value of SLURM job {job_id}"))[:VALUE_CHARS]
        elif report is not None and report.failure is not None:
            cell.state, cell.error = "failed", f"{report.failure.exc_type}: {report.failure.message}".splitlines()[0]
        elif states is None:
            continue
        elif job_id in states and states[job_id] not in ENDED:
            cell.state = "pending" if states[job_id] == "PENDING" else "running"
            cell.card = f"SLURM job {job_id}"
        else:
            ended = states.get(job_id, "gone from squeue")
            cell.state, cell.error = "failed", f"SLURM job {job_id} ended ({ended}) without a result"
    return [cells[i] for i in sorted(cells)]


def result(run: str, cell: int = 0, timeout: float | None = None) -> Any:
    """The value cell `cell` of run `run` (an id, a unique prefix, or 'last') returned, waiting for its SLURM job
    at most `timeout` s (None: as long as it runs); the job's own exception when it raised; JobCrashed when it
    ended without a result; JobTimeout when it still runs after `timeout`."""
    found = run_reader.find_run(run)
    folder = found.path / "slurm"
    job_id = _jobs(folder).get(str(cell), "")
    if not job_id:
        raise Levers9Error(
            f"run {found.name_on_disk} has no SLURM job of cell {cell} ({folder / JOBS_FILE} lists none). Expected a "
            f"run of @job(backend='slurm'); `levers9 runs show {found.name_on_disk}` lists its cells."
        )
    report_path = folder / f"{job_id}_0_result.pkl"
    deadline = None if timeout is None else time.monotonic() + timeout
    where = f"SLURM job {job_id} (run {found.name_on_disk}, cell {cell})"
    while not report_path.exists() and _running(job_id):
        if deadline is not None and time.monotonic() > deadline:
            raise outcomes.collected_still_running(where, timeout or 0.0)
        time.sleep(POLL_S)
    ended = _report(folder, job_id)
    if ended is None:
        raise outcomes.collected_without_result(where, cell, f"{folder / f'{job_id}_0_log.err'} and .out beside it")
    failure = ended.outcome.failure
    if failure is None:
        return unship_value(ended.outcome.value, f"the return value of {where}")
    raise outcomes.raised(failure, f"levers9: traceback of {where}, on {ended.node}:\n{failure.traceback.rstrip()}")


def register(runs_commands: Any) -> None:
    """`levers9 runs result RUN [CELL] [--timeout S]` (added to `levers9 runs` by cli/runs.py)."""
    parser = runs_commands.add_parser("result", help="a SLURM cell's value, once its job ends (slurm={'detach': True})")
    parser.add_argument("run", help="run id, a unique prefix of one, or 'last'")
    parser.add_argument("cell", type=int, nargs="?", default=0, help="the cell's index (default 0)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="wait at most this long")
    parser.set_defaults(handler=_main)


def _main(args: argparse.Namespace) -> int:
    """Print the cell's value (repr) and exit 0; its error and exit 1."""
    try:
        value = result(args.run, args.cell, args.timeout)
    except Exception as exc:
        print(f"levers9 runs result: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(repr(value))
    return 0
