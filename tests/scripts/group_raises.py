"""Every rank makes the group, then raises (as the DCP recipe's load does when there is no checkpoint)."""

import torch.distributed as dist

dist.init_process_group("gloo")
raise ValueError(f"rank {dist.get_rank()} could not load its shard")
