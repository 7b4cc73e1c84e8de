"""The start method follows what the caller has done: fork while CUDA is untouched, fresh interpreters after.

"CUDA initialised" is faked at the boundary the code reads: a tiny library named libcuda.so.1, built
here with gcc and loaded with ctypes, appears in /proc/self/maps exactly as the real driver would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.proc_util import is_torch_chatter

pytestmark = pytest.mark.procs

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_libcuda(tmp_path: Path) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    assert gcc, "gcc is needed to build the fake libcuda.so.1"
    source = tmp_path / "fake_cuda.c"
    source.write_text("int cuInit(unsigned int flags) { return 0; }\n")
    lib = tmp_path / "libcuda.so.1"
    subprocess.run([gcc, "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    return lib


SCRIPT = """
import ctypes, os, sys
import torch
from levers9 import distributed as dist
from levers9.procs.start import fork_is_safe

def fn(cfg):
    # A forked rank is a copy of the caller: it still has the caller's marker in __main__.
    import __main__
    return {"forked": hasattr(__main__, "CALLER_MARKER"), "pid": os.getpid(), "sum": dist.all_reduce_mean(torch.ones(1)).item()}

CALLER_MARKER = True
if __name__ == "__main__":
    print("before", fork_is_safe())
    if len(sys.argv) > 1:
        ctypes.CDLL(sys.argv[1])
    print("after", fork_is_safe())
    print("result", dist.run(fn, None, nprocs=2))
"""


def _run(tmp_path: Path, *args: str) -> str:
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run([sys.executable, str(script), *args], cwd=REPO, capture_output=True, text=True, timeout=180, env=os.environ)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_ranks_are_forked_while_cuda_is_untouched(tmp_path: Path) -> None:
    out = _run(tmp_path)
    assert "before (True, '')" in out and "after (True, '')" in out
    assert "'forked': True" in out and "'sum': 1.0" in out


def test_after_the_driver_is_loaded_ranks_are_fresh_interpreters(tmp_path: Path, fake_libcuda: Path) -> None:
    out = _run(tmp_path, str(fake_libcuda))
    assert "after (False, 'the CUDA driver (libcuda) is already loaded in this process')" in out
    assert "'forked': False" in out and "'sum': 1.0" in out


def test_fork_is_refused_by_name_when_unsafe(tmp_path: Path, fake_libcuda: Path) -> None:
    script = tmp_path / "refuse.py"
    script.write_text(
        "import ctypes, sys\nfrom levers9 import distributed as dist\nctypes.CDLL(sys.argv[1])\n"
        "try:\n    dist.run(print, None, nprocs=2, start_method='fork')\nexcept ValueError as e:\n    print('ERR', e)\n"
    )
    done = subprocess.run([sys.executable, str(script), str(fake_libcuda)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "ERR start_method='fork' is not safe here: the CUDA driver (libcuda) is already loaded" in done.stdout


REAPER = """
import ctypes, os, sys
# PR_SET_CHILD_SUBREAPER: orphaned descendants come to this process, as they come to PID 1 in a container,
# where PID 1 is often the user's own script, which never reaps processes it did not start.
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
from levers9 import distributed as dist, job
from tests import jobfns

print(list(job(gpu="RTXPro6000", stream_output=False)(jobfns.add).map(range(6), progress=False)))
print(dist.run(jobfns.add, 2, nprocs=2, backend="gloo"))
zombies = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        state, ppid = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[:2]
    except OSError:
        continue
    if int(ppid) == os.getpid() and state == "Z":
        zombies.append(pid)
print("zombies", zombies)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_cells_and_ranks_that_end_leave_no_zombie_with_a_reaper_that_never_reaps(tmp_path: Path, start_method: str) -> None:
    env = {
        **os.environ, "PYTHONPATH": str(REPO), "LEVERS9_START_METHOD": start_method,
        "LEVERS9_SIMULATE_GPUS": "RTXPro6000:4",
    }  # fmt: skip
    done = subprocess.run([sys.executable, "-c", REAPER], cwd=REPO, env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr
    seen = [line for line in done.stdout.splitlines() if not is_torch_chatter(line)]
    assert seen == ["[0, 1, 2, 3, 4, 5]", "2", "zombies []"], done.stdout + done.stderr
