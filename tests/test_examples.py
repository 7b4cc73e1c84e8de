"""Every example runs on a CPU-only machine, as its docstring says to run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.proc_util import children_of, left_behind

pytestmark = pytest.mark.launchers

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(args: list[str], **env: str) -> str:
    if args[0] in ("torchrun", "accelerate"):
        args = [str(BIN / args[0]), *args[1:]]
    else:
        args = [sys.executable, *args]
    before = set(children_of(os.getpid()))
    with tempfile.TemporaryDirectory() as tmp:  # torchrun's agent leaves torchelastic_* folders in $TMPDIR
        done = subprocess.run(
            args,
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp, **env},
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    assert left_behind(before) == []
    return done.stdout


def test_quickstart_runs_both_shapes() -> None:
    out = run(["examples/quickstart.py"])
    assert "No GPU here: the sweep runs on 4 simulated cards" in out
    cards = re.findall(r"lora_r=\s*(\d+) .* on card (\d)", out)
    assert [r for r, _ in cards] == ["8", "16", "32", "64"]  # input order
    assert sorted(c for _, c in cards) == ["0", "1", "2", "3"]  # one card each
    assert "rank 0 returned {'world_size': 2, 'final_loss':" in out
    assert out.count("step 0 loss=") == 1  # print0: rank 0 only


def test_sweep() -> None:
    out = run(["examples/sweep.py"], LEVERS9_SIMULATE_GPUS="RTXPro6000:4")
    assert re.findall(r"lora_r=\s*(\d+)", out) == ["8", "16", "32", "64"]
    assert "4 cells in" in out


@pytest.mark.parametrize("gpu_count", [1, 2])
def test_train_ddp_with_gpu_count_as_the_knob(gpu_count: int) -> None:
    run(["-m", "levers9", "workspace", "multi-gpu", "on"])
    out = run(["examples/train_ddp.py", "--gpu-count", str(gpu_count), "--steps", "12"], LEVERS9_SIMULATE_GPUS="RTXPro6000:4")
    assert f"'world_size': {gpu_count}" in out


def test_train_ddp_multi_card_needs_the_workspace_switch() -> None:
    args = [sys.executable, "examples/train_ddp.py", "--gpu-count", "2", "--steps", "2"]
    done = subprocess.run(args, cwd=REPO, env={**os.environ, "LEVERS9_SIMULATE_GPUS": "RTXPro6000:4"}, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "levers9 workspace multi-gpu on" in done.stderr


@pytest.mark.xdist_group("port-29500")
def test_torchrun_script() -> None:
    out = run(["torchrun", "--nproc-per-node", "2", "examples/torchrun_script.py"])
    assert "launcher=torchrun result={'world_size': 2" in out


@pytest.mark.parametrize("procs", [["--multi_gpu", "--num_processes", "2"], ["--num_processes", "1"]])
@pytest.mark.xdist_group("port-29500")
def test_accelerate_script(procs: list[str]) -> None:
    out = run(["accelerate", "launch", *procs, "examples/accelerate_script.py"])
    world = 2 if "2" in procs else 1
    assert f"launcher=accelerate result={{'world_size': {world}" in out


@pytest.mark.xdist_group("port-29500")
def test_existing_ddp_script() -> None:
    out = run(["torchrun", "--nproc-per-node", "2", "examples/existing_ddp_script.py"])
    assert "launcher=torchrun world_size=2 rank=0" in out
    assert out.count("step 19 loss=") == 1
