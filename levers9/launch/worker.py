"""`python -m levers9.launch.worker INPUT`: a job process started as a fresh interpreter.

Used when forking the caller is not safe (CUDA is already initialised there) or when
LEVERS9_JOB_START=exec asks for it. INPUT is a cloudpickle file written by the local executor: the
function (by reference when importable, by value when defined in __main__ or a notebook), its
arguments, the job environment, the caller's sys.path and the lifeline descriptor.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import cloudpickle


def resolve(module: str, qualname: str) -> Any:
    """The function `module.qualname` (a JobFunction's plain function if that is what is there)."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "func", obj)


def main(argv: list[str]) -> int:
    """Load the input file, run the cell, return the exit status."""
    from levers9.distributed.forking import die_with_parent
    from levers9.launch.runner import run_cell

    data = cloudpickle.loads(Path(argv[0]).read_bytes())
    die_with_parent(data["parent_pid"])
    for entry in reversed(data["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    if data["func_ref"] is not None:
        func = resolve(*data["func_ref"])
    else:
        func = cloudpickle.loads(data["func"])
    args, kwargs = cloudpickle.loads(data["arguments"])
    return run_cell(
        func,
        args,
        kwargs,
        env=data["env"],
        result_path=Path(data["result_path"]),
        lifeline_fd=data["lifeline_fd"],
    )


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)
