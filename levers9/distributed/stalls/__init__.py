"""Seeing stalled ranks: which rank waits in which collective, and where every rank is.

Each run started by `distributed.run` gets a private run folder holding
- `progress.bin`: one slot per rank, read by the parent to notice a stall (board.py);
- `sample-<rank>`: a FIFO asking that rank's thread for a fresh flight-recorder sample (sampler.py,
  flight_recorder.py);
- `stack-<rank>.txt`: where a rank writes every thread's Python stack on SIGUSR1 (report.py);
- `ranks.json`: the caller's pid and the ranks' pids, for `levers9 stacks` (runs.py).
Each rank's blocking `torch.distributed` calls are wrapped to update its slot (instrument.py).
"""

from levers9.distributed.stalls.board import RankSlot, RunFolder, remove_stale_runs
from levers9.distributed.stalls.instrument import instrument_collectives
from levers9.distributed.stalls.report import collect_stacks, describe_ranks, enable_stack_dumps, stalled
from levers9.distributed.stalls.runs import find_run, live_runs, report_for_run
from levers9.distributed.stalls.sampler import start_recorder_sampler

__all__ = [
    "RunFolder",
    "RankSlot",
    "enable_stack_dumps",
    "instrument_collectives",
    "start_recorder_sampler",
    "collect_stacks",
    "describe_ranks",
    "stalled",
    "find_run",
    "live_runs",
    "report_for_run",
    "remove_stale_runs",
]
