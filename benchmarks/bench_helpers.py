"""Helper overhead on 2 gloo ranks: all_reduce_mean vs a hand-written all_reduce + divide, a DDP training
step through `wrap` vs hand-written DistributedDataParallel (with stall detection on: levers9 wraps nothing
of torch's, so the step is torch's own), and what one flight-recorder sample for stall detection costs.

    python benchmarks/bench_helpers.py --rounds 7

Both sides do the same work (the hand-written mean clones its input too, since all_reduce_mean
never modifies it), are warmed up once, and take turns at going first; the table gives the median
of the per-round figures.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as td
from torch.nn.parallel import DistributedDataParallel

from levers9 import distributed as dist


def hand_mean(x: torch.Tensor) -> torch.Tensor:
    out = x.detach().clone()
    td.all_reduce(out)
    return out.div_(td.get_world_size())


def per_call(fn: Any, x: torch.Tensor, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


def steps_per_second(net: torch.nn.Module, steps: int) -> float:
    """Training steps per second of an already built (and warmed up) DDP model."""
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return steps / (time.perf_counter() - start)


def bench(cfg: dict[str, int]) -> dict[str, Any]:
    torch.set_num_threads(1)
    rows: dict[str, Any] = {}
    for size, calls in ((1, 2000), (1_000_000, 40)):
        x = torch.randn(size)
        rows[f"all_reduce_mean, {size:,} floats"] = alternate(
            lambda x=x, calls=calls: per_call(dist.all_reduce_mean, x, calls),
            lambda x=x, calls=calls: per_call(hand_mean, x, calls),
            cfg["rounds"],
        )
    # Both models are built once, so the rounds compare steps, not allocator and GC states after a build.
    wrapped, hand_built = dist.wrap(model()), DistributedDataParallel(model())
    rows["DDP step (steps/s)"] = alternate(
        lambda: steps_per_second(wrapped, 100), lambda: steps_per_second(hand_built, 100), cfg["rounds"]
    )
    return {"rows": rows, "sample_us": recorder_sample_us()}


def recorder_sample_us(samples: int = 2000) -> float:
    """What one flight-recorder sample costs the rank that answers it (microseconds)."""
    from levers9.distributed.stalls import board

    assert board.read_status() is not None, "torch's flight recorder recorded nothing"
    start = time.perf_counter()
    for _ in range(samples):
        board.read_status()
    return (time.perf_counter() - start) / samples * 1e6


def alternate(ours: Any, theirs: Any, rounds: int) -> tuple[float, float]:
    """Medians of `rounds` measurements each, after one warm-up each, taking turns at going first."""
    ours(), theirs()
    a: list[float] = []
    b: list[float] = []
    for i in range(rounds):
        if i % 2 == 0:
            a.append(ours())
            b.append(theirs())
        else:
            b.append(theirs())
            a.append(ours())
    return statistics.median(a), statistics.median(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    from levers9.distributed.stalls import board

    # stall_timeout on: the rows measure collectives and steps with stall detection fully at work.
    result = dist.run(bench, {"rounds": args.rounds}, nprocs=2, stall_timeout=600)
    rows = result["rows"]
    print("2 gloo ranks on CPU, one thread each; median of per-round figures")
    print()
    print("| measure | levers9 | hand-written | levers9 / hand-written |")
    print("| --- | --- | --- | --- |")
    for name, (ours, theirs) in rows.items():
        unit = "" if "steps" in name else " ms"
        scale = 1 if "steps" in name else 1000
        print(f"| {name} | {ours * scale:.3f}{unit} | {theirs * scale:.3f}{unit} | {ours / theirs:.3f}x |")
    print()
    print(
        f"A flight-recorder sample costs the rank {result['sample_us']:.1f} us; with stall_timeout= the caller asks "
        f"each rank for one every {board.QUIET_S:g} s."
    )


if __name__ == "__main__":
    main()
