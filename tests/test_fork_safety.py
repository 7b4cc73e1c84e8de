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
