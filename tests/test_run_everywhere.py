"""`distributed.run`'s keyword arguments on every path: spawned, in place, and under a launcher.

Each either works there or is refused with a ConfigError that says why and what to do instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from levers9 import distributed as dist
from levers9.errors import ConfigError, RunTimeout
from tests import rankfns

pytestmark = pytest.mark.launchers

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(30)
def test_timeout_in_place_stops_a_world_of_one() -> None:
    start = time.monotonic()
    with pytest.raises(RunTimeout, match=r"in place, a world of one\) timed out: still running after 1 s"):
        dist.run(rankfns.sleep_forever, None, timeout=1)
    assert time.monotonic() - start < 5
    assert dist.run(rankfns.describe, None, timeout=30)["world_size"] == 1  # and a run that finishes is untouched


UNDER_TORCHRUN = """
import sys, time, torch
from levers9 import distributed as dist

def fn(cfg):
    if dist.rank() == 1:
        time.sleep(60)                       # interrupted by its own timer
    dist.all_reduce_mean(torch.ones(1))      # rank 0 waits here, inside gloo, for rank 1
    return "finished"

print("result", dist.run(fn, None, timeout=2), flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.xdist_group("port-29500")
def test_timeout_under_torchrun_stops_every_rank_even_one_stuck_in_a_collective(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(UNDER_TORCHRUN)
    torchrun = str(Path(sys.executable).parent / "torchrun") if (Path(sys.executable).parent / "torchrun").exists() else shutil.which("torchrun")
    assert torchrun
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TMPDIR": tmp}
        start = time.monotonic()
        done = subprocess.run([torchrun, "--nproc-per-node", "2", str(script)], env=env, capture_output=True, text=True, timeout=80)
    took = time.monotonic() - start
    text = done.stdout + done.stderr
    assert done.returncode != 0 and "result finished" not in text
    assert "timed out: still running after 2 s (timeout=2)" in text, text
    assert took < 40, f"took {took:.0f} s"


def test_arguments_for_spawned_ranks_are_refused_where_none_are_spawned(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    assert dist.launcher() == "env"
    for kwargs, seen in (
        ({"stall_timeout": 5}, "stall_timeout=5 applies only to ranks distributed.run starts itself"),
        ({"prefix_output": False}, "prefix_output=False applies only"),
        ({"start_method": "spawn"}, "start_method='spawn' applies only"),
        ({"nprocs": 2}, "nprocs=2 but this process is already one of 1 rank(s) under env"),
    ):
        with pytest.raises(ConfigError, match=seen.replace("(", r"\(").replace(")", r"\)")):
            dist.run(rankfns.describe, None, **kwargs)
    with pytest.raises(ConfigError, match="unknown quirk id"):
        dist.run(rankfns.describe, None, disable_quirks=("no-such-id",))
    assert dist.run(rankfns.describe, None, disable_quirks=("shm-too-small",))["world_size"] == 1


def test_in_place_refuses_what_only_spawned_ranks_can_do() -> None:
    with pytest.raises(ConfigError, match="stall_timeout=3 applies only .* fn runs in place, as a world of one.* pass nprocs=2 or more"):
        dist.run(rankfns.describe, None, stall_timeout=3)
