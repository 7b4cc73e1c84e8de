"""The fast start never costs correctness: whatever the caller ran before, forked ranks and jobs run
their own multi-threaded work.

Each case is a fresh caller process (the state that matters is the caller's: its OpenMP team, its
OpenBLAS threads, its own live threads), with a time limit so that a hang fails instead of stalling.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs

REPO = Path(__file__).resolve().parents[1]

# Ran by every caller before levers9 starts anything: an OpenMP parallel region (torch's intra-op pool),
# OpenBLAS threads (numpy), and a thread of the caller's own that holds a lock and logs while ranks fork.
WARM_UP = """
import logging, threading, time
import numpy as np
import torch
torch.set_num_threads(2)
a = torch.randn(1500, 1500); a @ a                  # the caller's OpenMP team now exists
m = np.random.rand(600, 600); m @ m                 # and OpenBLAS's threads
logging.basicConfig(level=logging.INFO, stream=open("/dev/null", "w"))
busy = threading.Event()
def chatter():
    while not busy.is_set():
        logging.getLogger("caller").info("still here")  # holds the logging lock now and then
threading.Thread(target=chatter, daemon=True).start()
"""


def _caller(tmp_path: Path, body: str, env: dict[str, str] | None = None) -> str:
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(WARM_UP) + textwrap.dedent(body))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.timeout(150)
def test_ranks_run_parallel_work_after_the_caller_did(tmp_path: Path) -> None:
    out = _caller(
        tmp_path,
        """
        from levers9 import distributed as dist
        def fn(cfg):
            torch.set_num_threads(2)
            b = torch.randn(1500, 1500); b @ b
            n = np.random.rand(600, 600); n @ n
            logging.getLogger("rank").info("logging works in the rank")
            return dist.all_reduce_mean(torch.ones(1)).item(), torch.get_num_threads()
        print("result", dist.run(fn, None, nprocs=2, timeout=60))
        """,
    )
    assert "result (1.0, 2)" in out


@pytest.mark.timeout(150)
def test_job_cells_run_parallel_work_after_the_caller_did(tmp_path: Path) -> None:
    out = _caller(
        tmp_path,
        """
        from levers9 import job
        from tests import workloadfns
        cell = job(gpu="RTXPro6000", timeout=60)(workloadfns.threaded_matmul)
        print("result", list(cell.map([2, 2])))
        """,
        env={"LEVERS9_SIMULATE_GPUS": "RTXPro6000:2"},
    )
    expected = {"threads": 2, "same_on_every_rank": True}
    assert f"result {[expected, expected]}" in out


@pytest.mark.timeout(150)
def test_the_same_with_ranks_started_as_fresh_interpreters(tmp_path: Path) -> None:
    out = _caller(
        tmp_path,
        """
        from levers9 import distributed as dist
        from tests import workloadfns
        print("result", dist.run(workloadfns.threaded_matmul, 2, nprocs=2, timeout=60))
        """,
        env={"LEVERS9_START_METHOD": "spawn"},
    )
    assert "result {'threads': 2, 'same_on_every_rank': True}" in out


@pytest.mark.timeout(150)
def test_levers9s_own_forks_warn_nothing_and_leave_the_callers_warning_filters(tmp_path: Path) -> None:
    """Python 3.12+ warns on every fork of a process with threads. levers9's forks come from its forker thread on
    purpose, so a user who shows every DeprecationWarning (`-X dev`, pytest) must not see one per rank; the
    caller's filters are what they were, and a fork of the caller's own still warns as Python says it should."""
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent("""
        import os, sys, threading, warnings
        from levers9 import distributed as dist, job
        from tests import workloadfns
        before = list(warnings.filters)
        dist.run(workloadfns.threaded_matmul, 1, nprocs=2, timeout=60)
        job()(workloadfns.threaded_matmul).remote(1)
        print("filters kept:", warnings.filters == before)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        print("the caller's own fork warned:", any("fork()" in str(w.message) for w in seen))
        """))
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "always::DeprecationWarning", str(script)], cwd=REPO, capture_output=True,
        text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "filters kept: True" in done.stdout
    assert "multi-threaded, use of fork()" not in done.stderr
    assert f"the caller's own fork warned: {sys.version_info >= (3, 12)}" in done.stdout  # the forker thread is alive
