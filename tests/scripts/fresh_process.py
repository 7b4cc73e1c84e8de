"""What a fresh process has and does at its end, recorded per rank in OUT/<rank>.json and files beside it.

Run as a torchrun script (`script.py OUT [seed]`), or through `record(out, seed)` from a distributed.run fn.
Each rank writes: its unseeded (or seeded) random draws from torch, numpy, Python and a DataLoader
worker; its thread count; then leaves an open file unflushed, an atexit handler, a non-daemon thread
still saving, and (rank 1, when asked) an uncaught exception for its own sys.excepthook.
"""

import atexit
import json
import os
import random
import sys
import threading
import time


def _worker_seed(_: int) -> int:
    import torch

    return torch.initial_seed()


def record(out: str, seed: int | None = None, fail_rank: int | None = None) -> None:
    import numpy
    import torch
    from torch.utils.data import DataLoader

    rank = int(os.environ.get("RANK", "0"))
    if seed is not None:
        torch.manual_seed(seed)
        numpy.random.seed(seed)
        random.seed(seed)
    # Workers by fork, as a script written for Linux before Python 3.14 gets them (3.14's default is forkserver,
    # which cannot take a lambda under any launcher: docs/troubleshooting.md)
    loader = DataLoader(list(range(4)), num_workers=1, worker_init_fn=None, collate_fn=lambda batch: batch,
                        multiprocessing_context="fork")
    loader_seed = next(iter(DataLoader([0], num_workers=1, collate_fn=lambda b: _worker_seed(0),
                                       multiprocessing_context="fork")))
    del loader
    drawn = {
        "torch": torch.rand(3).tolist(),
        "numpy": numpy.random.rand(3).tolist(),
        "python": [random.random() for _ in range(3)],
        "loader_worker_seed": loader_seed,
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
    }
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(drawn, f)
    left_open = open(os.path.join(out, f"open.{rank}"), "w")  # never closed nor flushed: the end of the process does it
    left_open.write("seventeen bytes!\n")
    globals()["_left_open"] = left_open
    atexit.register(lambda: open(os.path.join(out, f"atexit.{rank}"), "w").write("ran"))

    def save() -> None:
        time.sleep(0.5)
        with open(os.path.join(out, f"thread.{rank}"), "w") as f:
            f.write("saved")

    threading.Thread(target=save, name="checkpoint-saver").start()  # not a daemon: the interpreter waits for it

    def hook(kind, value, tb) -> None:  # type: ignore[no-untyped-def]
        with open(os.path.join(out, f"excepthook.{rank}"), "w") as f:
            f.write(f"{kind.__name__}: {value}")

    sys.excepthook = hook
    if fail_rank == rank:
        raise RuntimeError(f"rank {rank} gives up")


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    args = sys.argv[1:]
    record(args[0], int(args[1]) if len(args) > 1 and args[1] != "-" else None,
           int(args[2]) if len(args) > 2 else None)
    dist.destroy_process_group()
