"""Seeing stalled ranks: which rank waits in which collective, and where every rank is.

Each run started by `distributed.run` gets a private board folder holding
- `progress.bin`: one slot per rank, read by the parent to notice a stall (board.py);
- `sample-<rank>`: a FIFO asking that rank's thread for a fresh flight-recorder sample (board.py);
- `stack-<rank>.txt`: where a rank writes every thread's Python stack on SIGUSR1 (report.py);
- `ranks.json`: the caller's pid and the ranks' pids, for `levers9 stacks` (find_board, below).
A run gets its folder only when `timeout=` or `stall_timeout=` asks for reports; nothing of torch's is
wrapped: what a rank waits for comes from torch's own flight recorder, where it is from stack dumps.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from levers9.distributed.stalls.board import (
    BOARD_DIR_PREFIX,
    BoardFolder,
    RankSlot,
    board_roots,
    fresh_states,
    read_slot,
    start_recorder_sampler,
)
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


# Finding boards from outside their runs (`levers9 stacks`): the board folder of a pid, every live one.

def _boards() -> Iterator[tuple[Path, Any]]:
    """Every board folder of this user's whose ranks.json can be read, with it."""
    for folder in sorted(folder for root in board_roots() for folder in root.glob(f"{BOARD_DIR_PREFIX}*")):
        try:
            data = json.loads((folder / "ranks.json").read_text())
        except (OSError, ValueError):
            continue
        yield folder, data


def find_board(pid: int) -> Path | None:
    """The board folder of the run whose caller or one of whose ranks has `pid`."""
    runs = (folder for folder, data in _boards() if pid == data.get("parent") or pid in data.get("pids", []))
    return next(runs, None)


def live_boards() -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every board folder whose caller is still alive, with its ranks.json."""
    for folder, data in _boards():
        try:
            os.kill(int(data["parent"]), 0)
        except (OSError, ValueError, KeyError):
            continue
        yield folder, data


def report_for_board(folder: Path) -> str:
    """The stall-style report for a live run, taken on demand without stopping it."""
    data = json.loads((folder / "ranks.json").read_text())
    pids = {rank: pid for rank, pid in enumerate(data["pids"])}
    with open(folder / "progress.bin", "rb") as f:
        board = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            states = fresh_states(folder, list(pids), lambda: [read_slot(board, rank) for rank in pids])
        finally:
            board.close()
    dumps = collect_stacks(pids, folder)
    return f"levers9 run of pid {data['parent']} ({len(pids)} ranks):\n" + describe_ranks(states, dumps, time.monotonic())
