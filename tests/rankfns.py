"""Importable functions that tests run on every rank (fresh-interpreter ranks import them by name)."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch

from levers9 import distributed as dist


class CustomError(Exception):
    """An exception type of the test's own, to check that the original type comes back."""


def describe(cfg: Any) -> dict[str, Any]:
    """Every rank's view of the world, gathered through a real all_reduce; rank 0 returns it."""
    mean = dist.all_reduce_mean(torch.tensor([float(dist.rank())]))
    return {
        "rank": dist.rank(),
        "world_size": dist.world_size(),
        "local_rank": dist.local_rank(),
        "launcher": dist.launcher(),
        "mean_rank": mean.item(),
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
        "cfg": cfg,
        "pid": os.getpid(),
    }


def fail_on_rank_1(cfg: Any) -> None:
    """Rank 1 raises CustomError; rank 0 waits in a collective it will never complete."""
    if dist.rank() == 1:
        raise CustomError(f"bad value {cfg!r} on rank 1")
    dist.barrier()
    time.sleep(60)


def exit_3_on_rank_1(cfg: Any) -> None:
    if dist.rank() == 1:
        sys.exit(3)
    dist.barrier()


def os_exit_on_rank_1(cfg: Any) -> None:
    if dist.rank() == 1:
        print("about to leave", flush=True)
        os._exit(7)
    dist.barrier()


def kill_self_on_rank_1(cfg: Any) -> None:
    if dist.rank() == 1:
        os.kill(os.getpid(), cfg or signal.SIGKILL)
        time.sleep(10)
    dist.barrier()


def sleep_forever(cfg: Any) -> None:
    print(f"sleeping on rank {dist.rank()}", flush=True)
    time.sleep(600)


def big_result(cfg: Any) -> bytes:
    """Rank 0 returns far more than a pipe buffer holds."""
    return b"x" * (cfg or 50_000_000)


def unpicklable_result(cfg: Any) -> dict[str, Any]:
    import threading

    return {"ok": 1, "lock": threading.Lock()}


def grandchild_then_fail(cfg: Any) -> None:
    """Each rank starts a long-lived grandchild (a DataLoader worker stand-in) and writes its pid; rank 1 fails."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(os.path.join(cfg, f"grandchild-{dist.rank()}"), "w") as f:
        f.write(str(child.pid))
    dist.barrier()
    if dist.rank() == 1:
        raise CustomError("rank 1 fails after starting a grandchild")
    time.sleep(60)


def train_steps(cfg: dict[str, Any]) -> dict[str, Any]:
    """A tiny DDP training with a fixed seed: the same losses on every launcher."""
    torch.manual_seed(0)
    model = dist.wrap(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    rows = [(torch.randn(4, generator=g), torch.randn(1, generator=g)) for _ in range(16)]
    losses = []
    for step in range(cfg.get("steps", 3)):
        x, y = rows[(step * dist.world_size() + dist.rank()) % len(rows)]
        loss = torch.nn.functional.mse_loss(model(x.to(dist.device())), y.to(dist.device()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(round(dist.all_reduce_mean(loss).item(), 6))
    dist.barrier()
    return {"losses": losses, "world_size": dist.world_size()}
