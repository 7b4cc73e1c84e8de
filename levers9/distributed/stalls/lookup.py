"""Finding boards from outside their runs: the board folder of a pid, every live one, and a report taken on demand (`levers9 stacks`)."""

from __future__ import annotations

import json
import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from levers9.distributed.stalls.board import BOARD_DIR_PREFIX, board_roots, read_slot
from levers9.distributed.stalls.report import collect_stacks, describe_ranks
from levers9.distributed.stalls.sampler import fresh_states


def _board_folders() -> list[Path]:
    return sorted(folder for root in board_roots() for folder in root.glob(f"{BOARD_DIR_PREFIX}*"))


def find_board(pid: int) -> Path | None:
    """The board folder of the run whose caller or one of whose ranks has `pid`."""
    for folder in _board_folders():
        info = folder / "ranks.json"
        try:
            data = json.loads(info.read_text())
        except (OSError, ValueError):
            continue
        if pid == data.get("parent") or pid in data.get("pids", []):
            return folder
    return None


def live_boards() -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every board folder whose caller is still alive, with its ranks.json."""
    for folder in _board_folders():
        try:
            data = json.loads((folder / "ranks.json").read_text())
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
