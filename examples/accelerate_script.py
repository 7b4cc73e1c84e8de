"""The training loop of train_ddp.py launched by `accelerate launch`: the helpers
read the variables accelerate sets, and an Accelerator created inside the loop
would share the same process group.

    # two processes (works on a CPU too), then one
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_script.py
    accelerate launch examples/accelerate_script.py
"""

from __future__ import annotations

from train_ddp import train_one_rank

from levers9 import distributed as dist

if __name__ == "__main__":
    result = dist.run(train_one_rank, {"steps": 20, "lr": 0.05})
    dist.print0(f"launcher={dist.launcher()} result={result}")
