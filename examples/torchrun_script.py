"""The training loop of train_ddp.py launched by torchrun: the process is already
a rank, and the helpers read torchrun's RANK / WORLD_SIZE / LOCAL_RANK.

    torchrun --nproc-per-node 2 examples/torchrun_script.py
"""

from __future__ import annotations

from train_ddp import train_one_rank

from levers9 import distributed as dist

if __name__ == "__main__":
    # joins torchrun's group and calls the loop in this rank; spawns nothing
    result = dist.run(train_one_rank, {"steps": 20, "lr": 0.05})
    dist.print0(f"launcher={dist.launcher()} result={result}")
