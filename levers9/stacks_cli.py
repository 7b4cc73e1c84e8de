"""`levers9 stacks PID`: where every rank of a live distributed.run is, without stopping it."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from levers9.distributed import stalls


def register(subparsers: Any) -> None:
    """Add the `stacks` subcommand."""
    parser = subparsers.add_parser(
        "stacks",
        help="show where every rank of a running distributed.run is (collective, file, line)",
        description="Ask every rank of a live run for its Python stack (SIGUSR1) and say which collective "
        "each one waits in. The run keeps going.",
    )
    parser.add_argument("pid", type=int, nargs="?", help="the pid of the process that called distributed.run, or of a rank")
    parser.set_defaults(handler=_stacks)


def _stacks(args: argparse.Namespace) -> int:
    if args.pid is None:
        runs = list(stalls.live_runs())
        if not runs:
            print("levers9 stacks: no levers9 run is alive on this machine. Expected a process that called "
                  "distributed.run; start one, or pass its pid: levers9 stacks PID", file=sys.stderr)
            return 1
        for run_folder, _ in runs:
            print(stalls.report_for_run(run_folder))
        return 0
    folder = stalls.find_run(args.pid)
    if folder is None:
        print(f"levers9 stacks: no levers9 run has pid {args.pid} as its caller or one of its ranks. Expected the pid "
              f"of a process in distributed.run (see `ps`); run `levers9 stacks` with no pid to list every live run.",
              file=sys.stderr)
        return 1
    print(stalls.report_for_run(folder))
    return 0
