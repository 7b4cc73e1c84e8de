"""Inside a SLURM job: one task of a submitted cell, called by submitit's worker under `srun`.

A job of one task (one node) is the job process: it enters the job's context (its cards, which
distributed.run inside reads, as on a workstation) and calls the function. A job across nodes has one
task per card, started by SLURM's srun (no levers9 agent runs there: SLURM is the launcher); each task is a
rank, and the function runs in every rank through `distributed.run`, which finds the world SLURM made
(levers9.distributed.detect). A restart of a job across nodes (max_restarts=) is a new job whose ranks see
TORCHELASTIC_RESTART_COUNT one higher, as under torchrun (backend.py). The ranks of a job across nodes
meet on a store rank 0 serves on a port it bound itself (`_meeting_place`), under a secret only the job's payload
holds, not on a port derived from the job id (which anyone who reads squeue could take first). Every task reports
back a job_process.TaskEnded (its value, or its failure with the traceback) in submitit's result file, never an
exception of its own, so the caller sees the job's exception with its type.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import cloudpickle

from levers9 import distributed as dist
from levers9 import runtime
from levers9.distributed import group
from levers9.distributed.control_store import serve_store
from levers9.distributed.restarts import attempt_env
from levers9.errors import LauncherEnvError
from levers9.launch import job_process
from levers9.launch.job_process import TaskEnded, TaskPayload, remove_scratch_dir, scratch_dir
from levers9.procs import interpreter
from levers9.procs.failure import capture, exit_status, ship_value
from levers9.procs.outcome import Outcome
from levers9.runtime import Runtime
from levers9.state_files import write_atomic

REQUEUE_WORDS = "nears its time limit: requeued"  # what the task prints (the caller's follower reads it)
MEET_WAIT_S = 300.0  # how long a rank waits for rank 0's store to be named (rank 0 may start later: its node's import)
_served: list[Any] = []  # rank 0's rendezvous store: it serves for as long as this task lives


def run_task(payload: TaskPayload) -> TaskEnded:
    """Run this task's part of the cell in `payload` and report how it ended (never raises an Exception); a run
    being requeued (at the time limit) ends without a report: the job's next run reports."""
    # submitit's worker ignores SIGTERM (it waits for a requeue); levers9's cancel is SIGTERM, then the kill after
    # stop_grace, as on a workstation: the default ends the task, and a handler the function installs can save
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    interpreter.relay_signals_to_main()  # the handlers run while the function computes, whatever thread gets a signal
    if payload.requeue and os.environ.get("SLURM_PROCID", "0") == "0":
        # SLURM's early signal before the time limit (--signal=USR2@N)
        requeue = functools.partial(_requeue, payload.folder, payload.spec.stop_grace, os.getpid())
        signal.signal(signal.SIGUSR2, requeue)
    else:  # the early signal of a requeued job's other ranks, or a SIGUSR2 sent by hand: submitit's handler would
        signal.signal(signal.SIGUSR2, _early_signal_ignored)  # raise UncompletedJobError in the function
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    job_dir = scratch_dir("slurm", payload.index, payload.attempt)
    try:
        returned = _call(payload, job_dir)
        if rank == 0 and payload.result_path:
            _store_for_resume(Path(payload.result_path), returned)
        value = ship_value(returned, "the job's return value")
        del returned
        outcome = Outcome(os.getpid(), 0, None, value=value, reported=True)
    except SystemExit as exc:
        outcome = Outcome(os.getpid(), 1, None, failure=capture(exc, exit_status(exc)), reported=True)
    except Exception as exc:
        outcome = Outcome(os.getpid(), 1, None, failure=capture(exc), reported=True)
    finally:
        remove_scratch_dir(job_dir)
    if payload.requeue and requeue_marker(payload.folder, os.environ.get("SLURM_JOB_ID", "")).exists():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no result file: what a handler's sys.exit() left is not this cell's outcome
    return TaskEnded.of(outcome, rank, node)


def _store_for_resume(path: Path, value: Any) -> None:
    """Keep a detached job's value where resume looks for it (as the caller's RunRecord.store does); a disk
    that refuses it costs resume, never the job."""
    try:
        write_atomic(path, cloudpickle.dumps(value))
    except Exception as exc:
        print(f"levers9: the value of this job was not kept for resume at {path} ({type(exc).__name__}: {exc})",
              file=sys.stderr, flush=True)  # fmt: skip


def _early_signal_ignored(_signum: int, _frame: Any) -> None:
    """SIGUSR2 in a job that did not ask to be requeued (SLURM sends it none: --signal=USR2@0) or in a rank after
    0's: nothing to do. The job runs on to its timeout= (which the caller enforces before SLURM's time limit) or the
    time limit."""


def requeue_marker(folder: str, job_id: str) -> Path:
    """The file that says SLURM job `job_id` is to be requeued once its tasks have ended (its batch script's
    teardown, `requeue_teardown`, requeues it and removes the file)."""
    return Path(folder) / f"{job_id}_requeue"


def requeue_teardown(folder: str) -> str:
    """The line after the job script's srun that requeues the job when its early signal asked for it: the job
    is still running then (its batch script is), so SLURM requeues it, and its next run starts as attempt n+1."""
    marker = f'{shlex.quote(folder)}/"$SLURM_JOB_ID"_requeue'
    return f'if [ -e {marker} ]; then rm -f {marker}; scontrol requeue "$SLURM_JOB_ID" && sleep 60; fi'


def _requeue(folder: str, grace: float, task_pid: int, _signum: int, _frame: Any) -> None:
    """The time limit is near: stop the job's tasks as a cancel does, with the job's stop_grace (SIGTERM to every
    task now, a handler of the function's can save; SIGKILL after stop_grace to what still runs), and mark the job
    for its script's teardown to requeue once they have ended. Asked of SLURM at once, the requeue would give
    a handler the cluster's KillWait instead. The stopper ignores SIGTERM (it is in the job, which gets it too)
    and kills only while the mark is its own: not a later run of the job. SLURM signals every process of the
    task: the ranks distributed.run forked inherit this handler and do nothing (one stopper, one SIGTERM each:
    a second one would end the job process while it gives its ranks their grace)."""
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if os.getpid() != task_pid or requeue_marker(folder, job_id).exists():
        return
    print(f"levers9: SLURM job {job_id} {REQUEUE_WORDS}, to resume from its checkpoint", file=sys.stderr, flush=True)
    marker, token = requeue_marker(folder, job_id), uuid.uuid4().hex
    marker.write_text(token)
    stopper = 'trap "" TERM; scancel --signal=TERM "$1"; sleep "$2"; [ "$(cat "$3" 2>/dev/null)" = "$4" ] && scancel --signal=KILL "$1"'
    subprocess.Popen(["sh", "-c", stopper, "sh", job_id, f"{grace:g}", str(marker), token],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


def _call(payload: TaskPayload, job_dir: Path) -> Any:
    payload.use_sys_path()
    func, args, kwargs = payload.call()
    spec = payload.spec
    ids = [c for c in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if c.strip()] if spec.gpu_count else []
    # the job's environment as on the other backends (job_env: thread counts, the user's env=, the cards in
    # PCI bus order, as SLURM numbers them); SLURM's cards, and none for a CPU job, which SLURM would leave
    # seeing every card of its node
    os.environ.update(job_process.job_env(spec, []), CUDA_VISIBLE_DEVICES=",".join(ids))
    attempt = payload.attempt + int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    context = job_process.task_context(spec, payload.run_id, payload.index, attempt, str(job_dir), ids)
    if payload.tasks == 1:
        return job_process.JobTarget(func, args, kwargs, context).call()
    os.environ.update(attempt_env(payload.restart, spec.max_restarts))  # this rank's restart count
    os.environ.update(_meeting_place(payload.folder, payload.secret))
    runtime.begin(Runtime(job=context))
    return dist.run(functools.partial(func, *args, **kwargs))


def _meeting_place(folder: str, secret: str) -> dict[str, str]:
    """Where this job's ranks make their group: rank 0 serves a store on a port it bound itself (or MASTER_PORT, if
    the job's environment names one) and names its node and port in the job's folder (the user's alone, on the file
    system every node shares); every other rank waits for that name. The group's keys start with `secret`
    (group.py), so a process of another user that connects cannot read or stand in for them. The store listens on
    every address of rank 0's node, as torch's own rendezvous store does, and the other ranks reach it by the node's
    name, as SLURM's node list gives it (a name that resolves to loopback on rank 0's own node, as Debian's 127.0.1.1
    does, changes nothing). The variables every rank gets: MASTER_ADDR and MASTER_PORT, as torchrun's ranks, and
    the store's and secret's."""
    job_id, run = os.environ.get("SLURM_JOB_ID", "0"), os.environ.get("SLURM_RESTART_COUNT", "0") or "0"
    named = Path(folder) / f"{job_id}_{run}_store"  # a requeued run of the job meets on a store of its own
    if os.environ.get("SLURM_PROCID", "0") == "0":
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        asked = os.environ.get("MASTER_PORT", "")
        try:
            store, port = serve_store("0.0.0.0", int(asked) if asked.isdigit() else 0)
        except OSError as exc:
            raise LauncherEnvError(
                f"rank 0 could not serve the ranks' store on {host} at port {asked} ({type(exc).__name__}: {exc}); the "
                f"port is MASTER_PORT={asked}, from the job's env= or the environment it was submitted from. Expected "
                f"a free port there: drop MASTER_PORT (unset it before submitting) and levers9 binds a free one itself."
            ) from exc
        _served.append(store)
        write_atomic(named, f"{host} {port}".encode())
    else:
        host, port = _wait_for_name(named)
    meet = {"MASTER_ADDR": host, "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    return {**meet, group.STORE_SECRET_VAR: secret} if secret else meet  # none in a job an older levers9 submitted


def _wait_for_name(named: Path) -> tuple[str, int]:
    """(host, port) of rank 0's store, once rank 0 has written them to `named`."""
    deadline = time.monotonic() + MEET_WAIT_S
    while True:
        with contextlib.suppress(FileNotFoundError, ValueError):
            host, port = named.read_text().split()
            return host, int(port)
        if time.monotonic() > deadline:
            raise LauncherEnvError(
                f"rank 0 of SLURM job {os.environ.get('SLURM_JOB_ID')} did not name its store in {named} within "
                f"{MEET_WAIT_S:g} s. Expected rank 0 started (its output, `sacct -j {os.environ.get('SLURM_JOB_ID')}`) "
                f"and the job's folder on a file system every node of the job shares."
            )
        time.sleep(0.05)
