"""Ordinary training code, as users write it, for ranks and job cells to run (importable by name, so
ranks and jobs started as fresh interpreters find them too)."""

from __future__ import annotations

import multiprocessing
import os
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from levers9 import distributed as dist


def threaded_matmul(threads: int) -> dict[str, Any]:
    """A matmul on `threads` intra-op threads; every rank's checksum averaged through a real all_reduce."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    a = torch.randn(600, 600)
    total = float((a @ a).sum())
    mean = dist.all_reduce_mean(torch.tensor([total])).item() if dist.world_size() > 1 else total
    return {"threads": torch.get_num_threads(), "same_on_every_rank": abs(mean - total) < 1e-3 * abs(total)}


class Squares(Dataset[torch.Tensor]):
    """Rows i -> [i, i*i], with the worker that produced each row."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        return torch.tensor([float(i), float(i * i), float(info.id if info else -1)])


def load_with_workers(cfg: dict[str, Any]) -> dict[str, Any]:
    """Two epochs through a DataLoader with worker processes (options from `cfg`): the rows seen and by whom."""
    loader = DataLoader(Squares(), batch_size=8, num_workers=2, **cfg)
    epochs = []
    for _ in range(2):
        rows = torch.cat(list(loader))
        epochs.append(sorted(int(r[0]) for r in rows))
        workers = sorted({int(r[2]) for r in rows})
    return {"epochs": epochs, "workers": workers, "rank": dist.rank()}


def _square(x: int) -> int:
    return x * x


def own_pool(n: int) -> list[int]:
    """The user's own multiprocessing.Pool inside a rank."""
    with multiprocessing.get_context("fork").Pool(2) as pool:
        squares = pool.map(_square, range(n))
    dist.barrier()
    return squares


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def compiled_model(cfg: Any) -> bool:
    """torch.compile of a small model (inductor, C++ on the CPU) agrees with the eager model."""
    torch.manual_seed(0)
    net = TinyNet()
    compiled = torch.compile(net)
    x = torch.randn(8, 16)
    same = torch.allclose(compiled(x), net(x), atol=1e-5)
    dist.barrier()
    return bool(same)


def print_a_lot(lines: int) -> int:
    """Rank 1 prints `lines` lines of 100 bytes as fast as it can; returns how many it printed."""
    if dist.rank() == 1:
        row = "x" * 90
        out = sys.stdout
        for i in range(lines):
            out.write(f"{i:08d} {row}\n")
        out.flush()
    dist.barrier()
    return lines


def big_bytes(size: int) -> bytes:
    """A result of `size` bytes (a rank returns it from rank 0, a cell returns it)."""
    return os.urandom(1024) * (size // 1024)
