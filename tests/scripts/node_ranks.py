"""One rank of a run across nodes (two launchers with --nnodes 2, as torchrun's or levers9 run's): prints one JSON
line with torchrun's variables, whether torch sees an elastic launch, and the all_reduce of rank+1 (10 on 4 ranks).
With argv[1] == "raise", global rank 2 (node 1's first) raises after a few steps while the others compute; with
"loop DIR", every rank writes DIR/ready-<rank> after its first step and computes until it is stopped."""

import json
import os
import sys

import torch
import torch.distributed as td

# torchrun's variables, read as the one-node script reads them (this script's folder is sys.path[0])
from worker_env import NAMES

if __name__ == "__main__":
    td.init_process_group("gloo")
    rank = td.get_rank()
    if sys.argv[1:] == ["raise"]:
        for step in range(1_000_000):  # small steps: the other ranks compute until they are stopped
            td.all_reduce(torch.ones(1))
            if rank == 2 and step == 3:
                raise ValueError("rank 2 could not read its shard")
    if sys.argv[1:2] == ["loop"]:
        td.all_reduce(torch.ones(1))
        open(os.path.join(sys.argv[2], f"ready-{rank}"), "w").close()
        while True:
            td.all_reduce(torch.ones(1))
    total = torch.tensor([float(rank + 1)])
    td.all_reduce(total)
    seen = {name: os.environ.get(name) for name in NAMES}
    seen.update(sum=total.item(), world=td.get_world_size(), elastic=td.is_torchelastic_launched())
    os.write(1, ("NODE_RANK " + json.dumps(seen) + "\n").encode())  # one write: torchrun's ranks share a stdout
    td.barrier()
    td.destroy_process_group()
