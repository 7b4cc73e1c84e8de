"""What runs inside a job process, and how its outcome comes back; shared by every backend.

`job_env` is the environment a job sees (its cards, LEVERS9_* facts about the job, the user's env).
`run_cell` runs in the job process: it applies that environment, watches the caller through a
lifeline pipe, applies GPU quirks on real cards, calls the function and writes the outcome file.
`read_outcome` turns that file back into the return value or the job's exception, in the caller.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import cloudpickle

from levers9.errors import NotShippableError, RemoteError
from levers9.launch.spec import JobSpec

RESULT_FILE = "result.pkl"


def job_env(
    spec: JobSpec,
    *,
    nvml_indices: list[int],
    gpu_type: str,
    simulated: bool,
    run_id: str,
    cell_index: int,
    attempt: int,
    job_dir: Path,
) -> dict[str, str]:
    """The variables a job process gets on top of the caller's environment."""
    env = dict(spec.env)
    if spec.cpu is not None:
        threads = str(max(1, math.ceil(spec.cpu)))
        env.setdefault("OMP_NUM_THREADS", threads)
        env.setdefault("MKL_NUM_THREADS", threads)
    env.update(
        CUDA_VISIBLE_DEVICES=",".join(map(str, nvml_indices)),
        CUDA_DEVICE_ORDER="PCI_BUS_ID",
        LEVERS9_RUN_ID=run_id,
        LEVERS9_JOB_ID=f"{run_id}/{cell_index}",
        LEVERS9_CELL_INDEX=str(cell_index),
        LEVERS9_ATTEMPT=str(attempt),
        LEVERS9_GPU_COUNT=str(len(nvml_indices)),
        LEVERS9_GPU_TYPE=gpu_type,
        LEVERS9_JOB_DIR=str(job_dir),
    )
    if simulated and nvml_indices:
        env["LEVERS9_SIMULATED"] = "1"
    if spec.stall_timeout is not None:
        env["LEVERS9_STALL_TIMEOUT"] = repr(spec.stall_timeout)
    return env


def run_cell(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    env: Mapping[str, str],
    result_path: Path,
    lifeline_fd: int | None,
) -> int:
    """Run one cell in this (job) process and write its outcome; returns the exit status to leave with."""
    os.environ.update(env)
    if "LEVERS9_SIMULATED" not in env:
        os.environ.pop("LEVERS9_SIMULATED", None)
    if lifeline_fd is not None:
        start_watchdog(lifeline_fd)
    try:
        gpu_count = int(env.get("LEVERS9_GPU_COUNT", "0"))
        if gpu_count > 0 and env.get("LEVERS9_SIMULATED") != "1":
            _apply_quirks(gpu_count)
        value = func(*args, **kwargs)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
        return code
    except BaseException as exc:
        _write(result_path, _failure(exc))
        return 0
    try:
        blob = cloudpickle.dumps(value)
    except Exception as exc:
        err = NotShippableError(
            f"the job returned a {type(value).__name__} that cannot be pickled ({type(exc).__name__}: {exc}); "
            f"return plain data (numbers, dicts, tensors moved to the CPU) or save it to a file and return the path."
        )
        _write(result_path, _failure(err))
        return 0
    _write(result_path, {"ok": True, "value": blob})
    return 0


def _apply_quirks(gpu_count: int) -> None:
    from levers9.distributed.hardware import quirks

    quirks.apply_quirks(local_world_size=gpu_count, backend="nccl", is_main=True)


def _failure(exc: BaseException) -> dict[str, Any]:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob: bytes | None = cloudpickle.dumps(exc)
    except Exception:
        blob = None
    return {
        "ok": False,
        "exc": blob,
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "traceback": text,
    }


def _write(path: Path, outcome: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(cloudpickle.dumps(outcome))
    os.replace(tmp, path)


def start_watchdog(lifeline_fd: int) -> int:
    """Fork a tiny process into this job's group that kills the whole group once the lifeline reads end
    of file (the caller died). A process, not a thread: it works while the job holds the GIL, and
    it outlives the job process, so the job's own children die too."""
    pid = os.fork()
    if pid != 0:
        os.close(lifeline_fd)
        return pid
    try:
        os.closerange(0, lifeline_fd)
        os.closerange(lifeline_fd + 1, 4096)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        while True:
            try:
                if not os.read(lifeline_fd, 1):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(0)


def read_outcome(job_dir: Path, label: str) -> tuple[bool, Any] | None:
    """(True, value) or (False, exception) from a finished job's outcome file; None if it wrote none."""
    path = job_dir / RESULT_FILE
    try:
        outcome = cloudpickle.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    if outcome["ok"]:
        return True, cloudpickle.loads(outcome["value"])
    exc: BaseException | None = None
    if outcome["exc"] is not None:
        try:
            exc = cloudpickle.loads(outcome["exc"])
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RemoteError(outcome["type"], outcome["message"], outcome["traceback"])
    add_note(exc, f"levers9: traceback of {label}, from its job process:\n{outcome['traceback'].rstrip()}")
    return False, exc


def add_note(exc: BaseException, note: str) -> None:
    """BaseException.add_note, also on Python 3.10."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        notes = getattr(exc, "__notes__", None) or []
        exc.__notes__ = [*notes, note]
