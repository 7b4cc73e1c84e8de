"""A torchrun script whose rank 1 ends by the signal argv[1] names (kill: SIGKILL, int: SIGINT) after a first
barrier, while rank 0 reacts to the lost peer with sys.exit(1), as minGPT-ddp's trainer does."""

import sys

import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
from tests.scriptfns import peer_killed  # noqa: E402

dist.init_process_group("gloo")
peer_killed(sys.argv[1])
