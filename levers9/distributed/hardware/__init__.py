"""What levers9 knows about the machine: cards (NVML), the NCCL library, GPU type names, platform facts and the quirk rows."""
