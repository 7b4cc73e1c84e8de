"""Ordinary training code works inside ranks (2 gloo ranks) and job cells (simulated cards): threads,
DataLoader workers, the user's own process pool, torch.compile, a flood of output, a huge result."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from levers9 import distributed as dist
from levers9.launch import job
from tests import workloadfns
from tests.proc_util import is_torch_chatter

pytestmark = pytest.mark.procs

LOADER_OPTIONS = [{}, {"persistent_workers": True, "pin_memory": True}]


@pytest.fixture(autouse=True)
def one_card(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:1")


def cell(fn: Any) -> Any:
    return job(gpu="RTXPro6000", stream_output=False, timeout=50)(fn)


@pytest.mark.timeout(60)
def test_two_threads_per_rank_run_a_matmul() -> None:
    assert dist.run(workloadfns.threaded_matmul, 2, nprocs=2, timeout=50) == {
        "threads": 2,
        "same_on_every_rank": True,
    }


@pytest.mark.timeout(60)
def test_two_threads_in_a_job_cell_run_a_matmul() -> None:
    assert cell(workloadfns.threaded_matmul).remote(2) == {"threads": 2, "same_on_every_rank": True}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", LOADER_OPTIONS, ids=["plain", "persistent-pinned"])
def test_a_dataloader_with_worker_processes_inside_ranks(options: dict[str, Any]) -> None:
    result = dist.run(workloadfns.load_with_workers, options, nprocs=2, timeout=50)
    assert result["epochs"] == [list(range(64))] * 2 and result["workers"] == [0, 1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", LOADER_OPTIONS, ids=["plain", "persistent-pinned"])
def test_a_dataloader_with_worker_processes_inside_a_job_cell(options: dict[str, Any]) -> None:
    result = cell(workloadfns.load_with_workers).remote(options)
    assert result["epochs"] == [list(range(64))] * 2 and result["workers"] == [0, 1]


@pytest.mark.timeout(60)
def test_the_users_own_process_pool_inside_ranks() -> None:
    assert dist.run(workloadfns.own_pool, 20, nprocs=2, timeout=50) == [i * i for i in range(20)]


# Over 20 s (about 27 s on 2 idle cores): a cold inductor cache compiles C++ for each rank, which is what
# torch.compile inside ranks is; ~80 s on 2 busy cores.
@pytest.mark.timeout(240)
def test_torch_compile_of_a_small_model_inside_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine: torch.compile's CPU backend needs one")
    # inductor's precompiled headers ignore TORCHINDUCTOR_CACHE_DIR (conftest) and go under
    # tempfile.gettempdir(), whose answer forked ranks inherit from this process: the test's folder
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert dist.run(workloadfns.compiled_model, None, nprocs=2, timeout=230) is True


@pytest.mark.timeout(60)
def test_a_rank_printing_tens_of_megabytes_delivers_all_of_it(capfd: pytest.CaptureFixture[str]) -> None:
    lines = 300_000  # 30 MB
    assert dist.run(workloadfns.print_a_lot, lines, nprocs=2, timeout=50) == lines
    out = capfd.readouterr().out.splitlines()
    printed = [line for line in out if line.startswith("[rank 1] ") and not is_torch_chatter(line)]
    assert len(printed) == lines
    assert printed[0].startswith("[rank 1] 00000000 ") and printed[-1].startswith(f"[rank 1] {lines - 1:08d} ")


SIZE = 300 * 2**20  # 300 MB


@pytest.mark.timeout(60)
def test_a_rank_returning_hundreds_of_megabytes() -> None:
    result = dist.run(workloadfns.big_bytes, SIZE, nprocs=2, timeout=50)
    assert len(result) == SIZE


@pytest.mark.timeout(60)
def test_a_job_cell_returning_hundreds_of_megabytes() -> None:
    result = cell(workloadfns.big_bytes).remote(SIZE)
    assert len(result) == SIZE


@pytest.mark.timeout(240)
def test_hugging_face_trainer_inside_fn_adopts_the_group(tmp_path: Path) -> None:
    out = dist.run(workloadfns.hf_trainer_in_fn, str(tmp_path), nprocs=2)
    assert out == {"group_before": True, "world": 2, "index": 0, "steps": 3, "same_group": True}
