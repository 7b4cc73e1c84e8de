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


def hf_trainer_in_fn(output_dir: str) -> dict[str, Any]:
    """Hugging Face's Trainer, as its examples use it, on a tiny randomly initialised BERT (nothing downloaded):
    inside distributed.run its accelerate state adopts the group fn starts in."""
    import torch.distributed as td
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    group_before = td.is_initialized()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8)
    rows = [{"input_ids": torch.tensor([1, i % 30 + 2, 3]), "attention_mask": torch.ones(3, dtype=torch.long),
             "labels": torch.tensor(i % 2)} for i in range(16)]  # fmt: skip
    args = TrainingArguments(output_dir=output_dir, max_steps=3, per_device_train_batch_size=2, use_cpu=True,
                             report_to=[], save_strategy="no", logging_strategy="no", dataloader_num_workers=0)  # fmt: skip
    trainer = Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=rows)
    trainer.train()
    return {"group_before": group_before, "world": trainer.args.world_size, "index": trainer.args.process_index,
            "steps": trainer.state.global_step, "same_group": td.get_world_size() == dist.world_size()}  # fmt: skip
