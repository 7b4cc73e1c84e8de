"""The helpers on two real gloo ranks started by distributed.run."""

from __future__ import annotations

import pytest

from levers9 import distributed as dist
from tests import rankfns

pytestmark = pytest.mark.procs


def test_helpers_on_two_ranks(capfd: pytest.CaptureFixture[str]) -> None:
    out = dist.run(rankfns.helper_answers, None, nprocs=2)
    assert out["mean"] == [1.5, 3.0]
    assert out["input_untouched"]
    assert out["ints"] == (1.5, "torch.float32")
    assert out["number"] == 5.0
    assert out["rows_covered"] == 7.0
    assert out["rank0_rows"] == [0, 1, 2, 3]
    assert out["padded"] == ([0, 1, 2, 3], 0)
    assert out["ddp"] == "DistributedDataParallel"
    assert out["device"] == "cpu"
    printed = capfd.readouterr().out
    assert "print0 from rank 0" in printed and "print0 from rank 1" not in printed


def test_rank_lines_carry_a_prefix_unless_turned_off(capfd: pytest.CaptureFixture[str]) -> None:
    dist.run(lambda: print(f"hello from {dist.rank()}"), nprocs=2)
    out = capfd.readouterr().out
    assert "hello from 0\n" in out and "[rank 0]" not in out and "[rank 1] hello from 1\n" in out
    dist.run(lambda: print(f"hello from {dist.rank()}"), nprocs=2, prefix_output=False)
    out = capfd.readouterr().out
    assert "[rank 1]" not in out and "hello from 1\n" in out


def test_accelerate_inside_fn_adopts_the_group() -> None:
    out = dist.run(rankfns.accelerate_adopts, None, nprocs=2)
    assert out == {"num_processes": 2, "process_index": 0, "accelerator_processes": 2, "sum": 1.0, "group_before": True}


def test_training_losses_match_across_world_sizes() -> None:
    from compat_tests.contract_script import contract

    one = dist.run(contract, {"steps": 3})
    two = dist.run(contract, {"steps": 3}, nprocs=2)
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert len(two["losses"]) == 3 and two["losses"] == one["losses"]  # DDP over a sharded global batch
