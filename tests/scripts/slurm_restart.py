"""Under `srun -N2 --ntasks-per-node=1 levers9 run --nproc-per-node 2 --max-restarts 1 THIS FOLDER`: a classic
script (its own init_process_group). In the first attempt rank 0 saves a checkpoint, then rank 3 (on the second
node) dies by SIGKILL while the others wait in a collective; the second attempt resumes from the checkpoint."""

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as td

from levers9 import distributed as dist

td.init_process_group("gloo")
checkpoint = Path(sys.argv[1]) / "checkpoint"
attempt = dist.restart_count() + 1
if attempt == 1 and dist.rank() == 0:
    checkpoint.write_text("step 5")
td.barrier()
if attempt == 1 and dist.rank() == 3:
    os.kill(os.getpid(), signal.SIGKILL)
total = torch.tensor([1.0])
td.all_reduce(total)
resumed = checkpoint.read_text()
print("ATTEMPT " + json.dumps({"rank": dist.rank(), "attempt": attempt, "sum": total.item(), "resumed": resumed,
                               "node": os.environ.get("SLURMD_NODENAME")}), flush=True)  # fmt: skip
td.destroy_process_group()
