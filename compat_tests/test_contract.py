"""The contract script under every launcher prints the same numbers (real processes, gloo on the CPU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.proc_util import children_of, left_behind

pytestmark = [pytest.mark.launchers, pytest.mark.xdist_group("port-29500")]

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "compat_tests" / "contract_script.py")
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"{name} is not installed: pip install -e '.[test]'"
    return found


LAUNCHES = {
    "plain python": [sys.executable, SCRIPT, "--mode", "direct"],
    "distributed.run nprocs=2": [sys.executable, SCRIPT, "--mode", "run", "--nprocs", "2"],
    "torchrun 2": ["torchrun", "--nproc-per-node", "2", SCRIPT, "--mode", "direct"],
    "torchrun 2 + distributed.run": ["torchrun", "--nproc-per-node", "2", SCRIPT, "--mode", "run"],
    "accelerate launch 2": ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", SCRIPT, "--mode", "run"],
    "accelerate launch 1": ["accelerate", "launch", "--num_processes", "1", SCRIPT, "--mode", "run"],
    "classic DDP script under torchrun": ["torchrun", "--nproc-per-node", "2", SCRIPT, "--mode", "own-init"],
    "@job gpu_count=2 + distributed.run": [sys.executable, SCRIPT, "--mode", "job"],
}
EXPECTED_LAUNCHER = {
    "plain python": "single",
    "distributed.run nprocs=2": "single",
    "torchrun 2": "torchrun",
    "torchrun 2 + distributed.run": "torchrun",
    "accelerate launch 2": "accelerate",
    "accelerate launch 1": "accelerate",
    "classic DDP script under torchrun": "torchrun",
    "@job gpu_count=2 + distributed.run": "single",  # the caller's; the job's ranks are levers9's
}


def _launch(name: str) -> tuple[dict, dict]:
    cmd = LAUNCHES[name]
    if cmd[0] in ("torchrun", "accelerate"):
        cmd = [_tool(cmd[0]), *cmd[1:]]
    with tempfile.TemporaryDirectory() as tmp:  # torchrun's agent leaves torchelastic_* folders in $TMPDIR
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TMPDIR": tmp}
        if "--mode" in cmd and cmd[cmd.index("--mode") + 1] == "job":  # two simulated cards, multi-GPU on
            env.update(LEVERS9_SIMULATE_GPUS="RTXPro6000:2", LEVERS9_CONFIG_DIR=f"{tmp}/config", LEVERS9_STATE_DIR=f"{tmp}/state")
            subprocess.run([sys.executable, "-m", "levers9", "workspace", "multi-gpu", "on"], env=env, check=True, capture_output=True)
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith(("CONTRACT ", "WORLD "))}
    assert "CONTRACT" in lines, f"{name} printed no CONTRACT line:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.count("CONTRACT ") == 1, f"{name}: only rank 0 may print:\n{done.stdout}"
    return lines["CONTRACT"], lines["WORLD"]


# Over 20 s (about 30 s on 2 idle cores, in the first test's set-up): eight real launches, torchrun and
# accelerate among them, each starting its ranks; both tests read the same results.
@pytest.fixture(scope="module")
def results() -> dict[str, tuple[dict, dict]]:
    before = set(children_of(os.getpid()))
    # Two lines of launches side by side: those that rendezvous on the default port 29500 one after
    # another, the others (no port, or port 0) beside them.
    on_29500 = [name for name in LAUNCHES if LAUNCHES[name][0] in ("torchrun", "accelerate") and "2" in LAUNCHES[name]]
    others = [name for name in LAUNCHES if name not in on_29500]
    with ThreadPoolExecutor(max_workers=2) as pool:
        lines = [pool.submit(lambda names: {name: _launch(name) for name in names}, group) for group in (on_29500, others)]
        out = {**lines[0].result(), **lines[1].result()}
    assert left_behind(before) == [], "a launcher left processes running"
    return out


def test_every_launcher_is_detected(results: dict[str, tuple[dict, dict]]) -> None:
    assert {name: world["launcher"] for name, (_, world) in results.items()} == EXPECTED_LAUNCHER


def test_every_launcher_prints_the_same_numbers(results: dict[str, tuple[dict, dict]]) -> None:
    single = results["plain python"][0]
    assert single["world_size"] == 1 and single["row_total"] == sum(range(1, 18))
    for name, (numbers, _) in results.items():
        assert numbers["losses"] == single["losses"], name
        assert numbers["row_total"] == single["row_total"], name
        expected = results["plain python"][0] if numbers["world_size"] == 1 else results["distributed.run nprocs=2"][0]
        assert numbers == expected, name
    assert results["torchrun 2"][0]["world_size"] == 2
