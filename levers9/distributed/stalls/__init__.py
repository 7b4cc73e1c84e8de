"""Seeing stalled ranks: which rank waits in which collective, and where every rank is.

Each run started by `distributed.run` gets a private board folder holding
- `progress.bin`: one slot per rank, read by the parent to notice a stall (board.py);
- `sample-<rank>`: a FIFO asking that rank's thread for a fresh flight-recorder sample (sampler.py,
  flight_recorder.py);
- `stack-<rank>.txt`: where a rank writes every thread's Python stack on SIGUSR1 (report.py);
- `ranks.json`: the caller's pid and the ranks' pids, for `levers9 stacks` (stalls/lookup.py).
A run gets its folder only when `timeout=` or `stall_timeout=` asks for reports; nothing of torch's is
wrapped: what a rank waits for comes from torch's own flight recorder, where it is from stack dumps.
The three functions below are what `distributed.run`'s parent and ranks call.
"""

from __future__ import annotations

import time

from levers9.distributed.stalls.board import BoardFolder, RankSlot
from levers9.distributed.stalls.lookup import find_board, live_boards, report_for_board
from levers9.distributed.stalls.report import (
    Quiet,
    collect_stacks,
    describe_ranks,
    enable_stack_dumps,
    quiet_of,
    stall_of,
    stall_text,
    stalled,
)
from levers9.distributed.stalls.sampler import start_recorder_sampler

__all__ = [
    "BoardFolder",
    "RankSlot",
    "watch_this_rank",
    "stalled_now",
    "Quiet",
    "quiet_now",
    "quiet_confirmed",
    "stall_of",
    "where_ranks_are",
    "enable_stack_dumps",
    "start_recorder_sampler",
    "collect_stacks",
    "describe_ranks",
    "stalled",
    "stall_text",
    "find_board",
    "live_boards",
    "report_for_board",
]


def watch_this_rank(folder: str, rank: int) -> RankSlot:
    """In a rank, before fn (only when timeout= or stall_timeout= asked): its stacks dumped on SIGUSR1 (faulthandler,
    for as long as the rank lives) and its flight recorder sampled on request by a daemon thread; the slot,
    in which levers9's own waits (forming the group) are marked."""
    enable_stack_dumps(folder, rank)
    slot = RankSlot(folder, rank)
    start_recorder_sampler(slot.record, folder, rank)
    return slot


def stalled_now(folder: BoardFolder, stall_timeout: float, now: float) -> bool:
    """In the parent: True once the ranks' slots show a stall of `stall_timeout` s (asking for recorder
    samples while the ranks are quiet), confirmed on a fresh sample from every rank."""
    # Confirmed on fresh samples only: on a loaded machine a sample can be answered late, and a count read
    # before the collective completed must not stand for a wait that has since ended.
    return stall_of([quiet_now(folder, now)], stall_timeout) and stall_of([quiet_confirmed(folder)], stall_timeout)


def quiet_now(folder: BoardFolder, now: float) -> Quiet:
    """The board as last written (asking for recorder samples, at most once a second, while the ranks are quiet)."""
    states = folder.states()
    folder.sample_when_quiet(states, now)
    return quiet_of(states, now)


def quiet_confirmed(folder: BoardFolder) -> Quiet:
    """The board after a fresh recorder sample from every rank (a few seconds at most)."""
    return quiet_of(folder.fresh_states(list(range(folder.nprocs))), time.monotonic())


def where_ranks_are(folder: BoardFolder, live: dict[int, int], names: list[str] | None = None) -> str:
    """In the parent: where each live rank (its slot on the board -> pid) is, from fresh slots and its stack
    dump; `names` labels each slot ('rank 2 on node 1 (10.0.0.3)'; default 'rank <slot>')."""
    stopped = folder.stopped()
    answering = {slot: pid for slot, pid in live.items() if slot not in stopped}
    states = folder.fresh_states(list(live))
    return describe_ranks(states, collect_stacks(answering, folder.path), time.monotonic(), names, stopped)
