"""`levers9 stacks PID`: where every rank of a live distributed.run is, without stopping it."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from levers9.distributed import stalls

_WHY = ("only such runs give their ranks a SIGUSR1 stack-dump handler (levers9 installs nothing in a rank unless a "
        "feature asks for it). Start the run with --timeout or --stall-timeout, or run `levers9 stacks` with no pid "
        "to list the live runs that have one.")


def register(subparsers: Any) -> None:
    """Add the `stacks` subcommand."""
    parser = subparsers.add_parser(
        "stacks",
        help="show where every rank of a running distributed.run is (collective, file, line)",
        description="Ask every rank of a live run for its Python stack (SIGUSR1) and say which collective "
        "each one waits in. The run keeps going. Works on runs started with timeout= or stall_timeout=.",
    )
    parser.add_argument("pid", type=int, nargs="?", help="the pid of the process that called distributed.run, or of a rank")
    parser.set_defaults(handler=_stacks)


def _stacks(args: argparse.Namespace) -> int:
    if args.pid is None:
        runs = list(stalls.live_boards())
        if not runs:
            print("levers9 stacks: no levers9 run with stack dumps is alive on this machine. Expected a process in "
              f"distributed.run started with timeout= or stall_timeout= (`levers9 run --timeout S`); {_WHY}",
              file=sys.stderr)  # fmt: skip
            return 1
        for run_folder, _ in runs:
            print(stalls.report_for_board(run_folder))
        return 0
    folder = stalls.find_board(args.pid)
    if folder is None:
        print(f"levers9 stacks: no levers9 run with stack dumps has pid {args.pid} as its caller or one of its ranks. "
              f"Expected the pid of a process in a distributed.run started with timeout= or stall_timeout= (see `ps`); "
              f"{_WHY}", file=sys.stderr)  # fmt: skip
        return 1
    print(stalls.report_for_board(folder))
    return 0
