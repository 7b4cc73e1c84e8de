"""levers9 under a real SLURM 22.05: two nodes (two slurmd on this machine), 2 GRES cards each
(tests/slurm_cluster.py starts compat_tests/slurm_cluster.sh). Real srun and sbatch, never a mock.

The cards are device files SLURM hands out as CUDA_VISIBLE_DEVICES; the ranks run on gloo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import slurm_cluster

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parent.parent
RANKS = ROOT / "tests" / "scripts" / "slurm_ranks.py"


@pytest.fixture
def env(request: pytest.FixtureRequest) -> dict[str, str]:
    """This test's environment (no launcher variables) with the session cluster's SLURM_CONF."""
    conf = slurm_cluster.slurm_conf(request.config)
    return {**os.environ, "SLURM_CONF": conf, "PYTHONPATH": str(ROOT)}


def srun(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`srun ARGS`, its output as text; a hang fails the test at `timeout`."""
    return subprocess.run(["srun", *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def ranks_seen(out: str) -> list[dict[str, object]]:
    """The RANK lines of tests/scripts/slurm_ranks.py, sorted by rank."""
    lines = [json.loads(line.partition("RANK ")[2]) for line in out.splitlines() if "RANK {" in line]
    return sorted(lines, key=lambda r: int(str(r["rank"])))


def test_srun_two_nodes_two_tasks_each(env: dict[str, str]) -> None:
    done = srun(env, "-N2", "--ntasks-per-node=2", sys.executable, str(RANKS))
    assert done.returncode == 0, done.stderr
    seen = ranks_seen(done.stdout)
    assert [(r["rank"], r["local_rank"], r["node_rank"], r["node"]) for r in seen] == [
        (0, 0, 0, "l9node1"), (1, 1, 0, "l9node1"), (2, 0, 1, "l9node2"), (3, 1, 1, "l9node2"),
    ]  # fmt: skip
    assert {(r["world_size"], r["local_world_size"], r["launcher"], r["sum"]) for r in seen} == {(4, 2, "slurm", 4.0)}
    assert done.stdout.count("VALUE 0") == 4  # rank 0's value on every rank


def test_srun_one_node_two_tasks(env: dict[str, str]) -> None:
    done = srun(env, "-N1", "-n2", sys.executable, str(RANKS))
    assert done.returncode == 0, done.stderr
    seen = ranks_seen(done.stdout)
    assert [(r["rank"], r["local_rank"], r["node_rank"], r["world_size"], r["sum"]) for r in seen] == [
        (0, 0, 0, 2, 2.0), (1, 1, 0, 2, 2.0),
    ]  # fmt: skip


def test_one_task_with_cards_starts_its_own_ranks(env: dict[str, str]) -> None:
    """`srun -n1` (an sbatch job of one task): distributed.run starts the ranks, as on a workstation."""
    done = srun(env, "-N1", "-n1", "--gres=gpu:2", sys.executable, str(RANKS), "2")
    assert done.returncode == 0, done.stderr
    seen = ranks_seen(done.stdout)
    assert [(r["rank"], r["world_size"], r["launcher"]) for r in seen] == [(0, 2, "levers9"), (1, 2, "levers9")]


def test_unresolvable_master_is_one_error_within_seconds(env: dict[str, str]) -> None:
    started = time.monotonic()
    done = srun({**env, "MASTER_ADDR": "no-such-node.invalid"}, "-N1", "-n2", sys.executable, str(RANKS), timeout=90)
    assert done.returncode != 0
    assert "The rendezvous host 'no-such-node.invalid' (from MASTER_ADDR) does not resolve" in done.stderr
    assert time.monotonic() - started < 60


def test_tasks_per_node_not_matching_cards_names_the_sbatch_line(env: dict[str, str]) -> None:
    done = srun(env, "-N2", "--ntasks-per-node=1", "--gres=gpu:2", sys.executable, str(RANKS), timeout=90)
    assert done.returncode != 0
    assert "1 card(s) would sit idle" in done.stderr
    assert "change `#SBATCH --ntasks-per-node=1` to `#SBATCH --ntasks-per-node=2`" in done.stderr


def test_job_script_without_srun_names_the_sbatch_line(env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH -N1 --ntasks-per-node=2\n{sys.executable} {RANKS}\n")
    out = tmp_path / "job.out"
    done = subprocess.run(["sbatch", "--wait", "-o", str(out), str(script)], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # fmt: skip
    assert done.returncode != 0
    text = out.read_text()
    assert "was not started by srun (no SLURM_STEP_ID)" in text
    assert f"`srun python {RANKS}`" in text and "`#SBATCH --ntasks-per-node=2`" in text
