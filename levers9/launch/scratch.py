"""A job's scratch folder on the node it runs on (its context's `job_dir`), made by a Ray task or a SLURM task.

Each kind of task keeps its folders under one private root of this user's (`<tmp>/levers9-<kind>-<uid>`, 0700):
a folder is removed when its task ends, the root with it once no other job uses it, and the folders of tasks
that were killed before they could clean up (a cancel, a lost caller, a time limit) are removed by the next
task on the node, so none accumulates in the node's temp folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from levers9.private_dir import private_dir
from levers9.procs.watch import pid_alive


def scratch_dir(kind: str, index: int, attempt: int) -> Path:
    """A fresh folder for cell `index`'s attempt, under this user's root for `kind` ("ray", "slurm") of tasks;
    folders of dead tasks there are removed first."""
    root = Path(tempfile.gettempdir()) / f"levers9-{kind}-{os.getuid()}"
    for _ in range(10):
        try:  # the task that empties the root removes it: it can vanish at any step below
            private_dir(root)
            with contextlib.suppress(OSError):
                for stale in root.iterdir():
                    owner = stale.name.partition("-")[0]
                    if owner.isdigit() and not pid_alive(int(owner)):
                        shutil.rmtree(stale, ignore_errors=True)
            return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-{index:04d}-{attempt}-", dir=root))
        except FileNotFoundError:
            continue
    return Path(tempfile.mkdtemp(prefix=f"levers9-{kind}-{os.getpid()}-"))


def remove_scratch_dir(folder: Path) -> None:
    """Remove a folder `scratch_dir` made, and its root once no other job uses it."""
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        folder.parent.rmdir()
