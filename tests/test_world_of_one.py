"""Every helper answers as a world of one when nothing launched us, and reads a launcher's environment."""

from __future__ import annotations

import pytest
import torch

from levers9 import distributed as dist
from levers9.distributed.helpers import PaddedShard
from levers9.errors import LauncherEnvError

pytestmark = pytest.mark.fast


def test_world_of_one_answers() -> None:
    assert (dist.rank(), dist.local_rank(), dist.world_size(), dist.local_world_size(), dist.node_rank()) == (0, 0, 1, 1, 0)
    assert dist.is_main() and dist.launcher() == "single"
    assert dist.device() == torch.device("cpu")


def test_helpers_read_the_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(key, value)
    assert (dist.rank(), dist.world_size(), dist.local_rank(), dist.local_world_size(), dist.node_rank()) == (3, 4, 1, 2, 1)
    assert not dist.is_main() and dist.launcher() == "torchrun"
    monkeypatch.setenv("RANK", "0")  # a changed variable is seen on the next call
    assert dist.is_main()


def test_a_partial_environment_raises_from_the_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(LauncherEnvError, match="WORLD_SIZE"):
        dist.rank()


def test_wrap_in_a_world_of_one_is_the_model_itself() -> None:
    model = torch.nn.Linear(2, 2)
    assert dist.wrap(model) is model


def test_wrap_never_wraps_twice() -> None:
    import torch.distributed as td
    from torch.nn.parallel import DistributedDataParallel

    td.init_process_group("gloo", store=td.HashStore(), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(torch.nn.Linear(2, 2))
        assert dist.wrap(ddp) is ddp
    finally:
        td.destroy_process_group()


def test_all_reduce_mean_world_of_one_is_a_detached_copy() -> None:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    out = dist.all_reduce_mean(x)
    assert torch.equal(out, x.detach()) and not out.requires_grad
    out += 1
    assert torch.equal(x.detach(), torch.tensor([1.0, 2.0]))


def test_all_reduce_mean_of_numbers_and_ints() -> None:
    assert dist.all_reduce_mean(3).item() == 3.0
    assert dist.all_reduce_mean(torch.tensor([1, 2])).dtype == torch.get_default_dtype()


def test_print0_prints_on_rank_0_only(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    dist.print0("hello", 1)
    assert capsys.readouterr().out == "hello 1\n"
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(key, value)  # rank 1 of 2, local rank 0 on its node: not global rank 0
    dist.print0("not me")
    assert capsys.readouterr().out == ""


def test_barrier_is_a_no_op_in_a_world_of_one() -> None:
    dist.barrier()


def test_shard_world_of_one_is_everything() -> None:
    assert dist.shard([1, 2, 3]) == [1, 2, 3]
    assert dist.shard([1, 2, 3], pad=True) == PaddedShard([1, 2, 3], 0)


def _shards(monkeypatch: pytest.MonkeyPatch, rows: list[int], ranks: int, pad: bool) -> list:
    out = []
    for r in range(ranks):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", str(ranks))
        out.append(dist.shard(rows, pad=pad))
    return out


@pytest.mark.parametrize("n", [0, 1, 5, 7, 8, 13])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_shards_cover_every_row_once_and_differ_by_at_most_one(monkeypatch: pytest.MonkeyPatch, n: int, ranks: int) -> None:
    rows = list(range(n))
    shards = _shards(monkeypatch, rows, ranks, pad=False)
    assert sorted(x for s in shards for x in s) == rows
    assert [x for s in shards for x in s] == rows  # contiguous, in order
    lengths = [len(s) for s in shards]
    assert max(lengths) - min(lengths) <= 1


@pytest.mark.parametrize("n", [1, 5, 7, 8])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_padded_shards_are_equal_and_say_how_much_is_padding(monkeypatch: pytest.MonkeyPatch, n: int, ranks: int) -> None:
    rows = list(range(n))
    shards = _shards(monkeypatch, rows, ranks, pad=True)
    assert len({len(s.rows) for s in shards}) == 1
    real = [x for s in shards for x in s.rows[: len(s.rows) - s.padding]]
    assert real == rows
    assert sum(s.padding for s in shards) == len(shards[0].rows) * ranks - n


def test_a_local_rank_without_a_card_is_an_error_naming_both_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    from levers9.distributed import devices
    from levers9.errors import DeviceError

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    visible = torch.cuda.device_count()
    with pytest.raises(DeviceError) as info:
        devices.cuda_index_for_local_rank(visible + 1)
    text = str(info.value)
    assert f"LOCAL_RANK={visible + 1}" in text and f"only {visible} card(s)" in text and "--nproc-per-node" in text
