"""What levers9 knows about the machine: cards (NVML), the NCCL library, GPU type names, platform facts, the
cgroup's out-of-memory-kill counter, and the quirk rows."""
