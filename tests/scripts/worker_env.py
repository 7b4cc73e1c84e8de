"""Prints, as one JSON line per rank, the launcher variables this worker sees and what torch says about them."""

import json
import os
import sys

import torch.distributed as dist

NAMES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS",
)
if __name__ == "__main__":
    dist.init_process_group("gloo")
    seen = {name: os.environ.get(name) for name in NAMES}
    seen["is_torchelastic_launched"] = dist.is_torchelastic_launched()
    seen["argv"] = sys.argv[1:]
    seen["main"] = __name__
    # One write() per line: under torchrun both ranks share one stdout, and with PYTHONUNBUFFERED a print
    # writes the text and its newline separately, so two ranks' lines could interleave.
    os.write(1, ("ENV " + json.dumps(seen) + "\n").encode())
    if "--out" in sys.argv:
        folder = sys.argv[sys.argv.index("--out") + 1]
        with open(os.path.join(folder, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(seen, f)
    dist.barrier()
    dist.destroy_process_group()
