"""`levers9 runs ...`: find, read and clean the run folders that sweeps and jobs leave.

levers9 runs                              # recent runs: id, name, started, done/failed/total, wall time
levers9 runs show RUN                     # its cells: arguments, state, card, duration, error
levers9 runs logs RUN CELL [-f]           # a cell's output (-f: follow it while it runs)
levers9 runs clean [--older-than 7d] [--keep N]

RUN is a run id, a unique prefix of one, or `last`. Without options, `clean` applies the default
retention (the newest 50 runs, or $LEVERS9_KEEP_RUNS), which also runs each time a run starts.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from levers9.cli import said_as, whole_number
from levers9.errors import Levers9Error
from levers9.launch import run_folder, run_reader
from levers9.launch.settings import runs_dir
from levers9.launch.slurm import collect as slurm_collect
from levers9.seconds import say_duration
from levers9.state_files import read_private

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def register(subparsers: Any) -> None:
    """Add `runs` and its subcommands to the levers9 command."""
    parser = subparsers.add_parser("runs", help="past and running sweeps: list, show, logs, clean")
    parser.set_defaults(handler=_list, limit=20)
    sub = parser.add_subparsers(dest="runs_command", metavar="ACTION")
    listing = sub.add_parser("list", help="recent runs (the default action)")
    listing.add_argument("-n", "--limit", type=int, default=20, help="how many of the newest runs (0: all)")
    listing.set_defaults(handler=_list)
    show = sub.add_parser("show", help="a run's cells: arguments, state, card, duration, error")
    show.add_argument("run", help="run id, a unique prefix of one, or 'last'")
    show.set_defaults(handler=_show)
    logs = sub.add_parser("logs", help="a cell's output (stdout, then stderr, for each attempt)")
    logs.add_argument("run", help="run id, a unique prefix of one, or 'last'")
    logs.add_argument("cell", type=int, help="the cell's index (its position in the map's inputs)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing while the cell runs")
    logs.set_defaults(handler=_logs)
    clean = sub.add_parser("clean", help="remove old run folders (never one whose caller still runs)")
    clean.add_argument("--older-than", type=_age, metavar="AGE", help="e.g. 90m, 12h, 7d, 2w")
    clean.add_argument("--keep", type=whole_number("runs", 0), metavar="N", help="keep the newest N runs")
    clean.set_defaults(handler=_clean)
    slurm_collect.register(sub)  # `levers9 runs result`: a detached SLURM job's value (issue 42)


def _age(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a number and a unit (s, m, h, d, w) such as 7d, got {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _say_skipped(skipped: Sequence[Levers9Error]) -> None:
    """One line on stderr per run folder that could not be read (each names its folder and fix)."""
    for problem in skipped:
        print(f"levers9 runs: skipped: {problem}", file=sys.stderr)


@said_as("levers9 runs: error", 2)
def _list(args: argparse.Namespace) -> int:
    found, skipped = run_reader.scan_runs()
    _say_skipped(skipped)
    if args.limit:
        found = found[-args.limit :]
    if not found:
        print(f"no runs under {runs_dir()}")
        return 0
    rows = []
    for run in reversed(found):
        try:
            detached = slurm_collect.detached_cells(run)  # its caller gone, SLURM says how its jobs are
            done, failed, total = run.counts() if detached is None else _counts(detached)
        except Levers9Error as exc:
            _say_skipped([exc])
            continue
        end = run.ended if run.ended is not None else time.time() if run.alive else None
        wall = "" if end is None else say_duration(end - run.started, tenths=True)
        rows.append(
            [run.name_on_disk, str(run.meta.get("name", "?")), str(run.meta.get("backend", "?")), _when(run.started),
             f"{done}/{failed}/{total}", wall, run.status if detached is None else "detached"]
        )  # fmt: skip
    _table(["run", "name", "backend", "started", "done/failed/total", "wall", "status"], rows)
    return 0


@said_as("levers9 runs: error", 2)
def _show(args: argparse.Namespace) -> int:
    run = run_reader.find_run(args.run)
    detached = slurm_collect.detached_cells(run)
    cells = run.cells() if detached is None else detached
    print(f"{run.name_on_disk}: {run.meta.get('function', '?')} on {run.meta.get('backend', '?')}, "
          f"started {_when(run.started)}, {run.status if detached is None else 'detached'}")  # fmt: skip
    rows = []
    for cell in cells:
        took = "" if cell.took is None else say_duration(cell.took, tenths=True)
        state = "done (reused)" if cell.reused else cell.state
        if cell.attempt > 1:
            state += f" (attempt {cell.attempt})"
        rows.append([f"#{cell.index}", cell.args, state, cell.card, took, cell.error or cell.value])
    _table(["cell", "arguments", "state", "card", "duration", "error" if detached is None else "error or value"], rows)
    if run.skipped_events:
        print(f"levers9 runs: skipped {run.skipped_events} line(s) of {run.path / run_reader.EVENTS_FILE} that are not "
              f"as levers9 writes them (cut short by a crash, or edited); the states above leave them out",
              file=sys.stderr)  # fmt: skip
    return 0


@said_as("levers9 runs: error", 2)
def _logs(args: argparse.Namespace) -> int:
    run = run_reader.find_run(args.run)
    cell = run.cell(args.cell)
    attempts = run_reader.attempt_folders(run, args.cell)
    if not attempts and not args.follow:
        print(f"cell #{args.cell} has no output ({cell.state})", file=sys.stderr)
        return 0
    for folder in attempts[:-1] if args.follow else attempts:
        _print_attempt(folder, len(attempts))
    if args.follow:
        _follow(run, args.cell)
    return 0


def _print_attempt(folder: Any, attempts: int) -> None:
    if attempts > 1:
        print(f"--- attempt {folder.name.split('-')[-1]} ---")
    for name in ("stdout.log", "stderr.log"):
        path = folder / name
        try:
            sys.stdout.write(read_private(path, limit=1 << 40).decode(errors="replace"))
        except FileNotFoundError:
            continue
        except OSError as exc:  # a symlink, a FIFO, someone else's: never followed, never waited on
            print(f"levers9 runs: skipped {path}: {exc.strerror or exc}", file=sys.stderr)
    sys.stdout.flush()


def _follow(run: run_reader.Run, index: int) -> None:
    """Print the cell's newest attempt as it grows, until the cell has ended or its caller is gone."""

    def going() -> bool:
        cells = run_reader.read_run(run.path).cells()
        return next((c.state for c in cells if c.index == index), "done") in ("waiting", "running", "retrying")

    followed = 0
    try:
        while True:
            attempts = run_reader.attempt_folders(run, index)
            if len(attempts) > followed:
                followed = len(attempts)
                folder = attempts[-1]

                def current(seen: int = followed) -> bool:
                    return going() and len(run_reader.attempt_folders(run, index)) == seen

                for text in run_reader.follow([folder / "stdout.log", folder / "stderr.log"], current):
                    sys.stdout.write(text)
                    sys.stdout.flush()
            elif not going():
                return
            else:
                time.sleep(0.2)
    except KeyboardInterrupt:
        return


@said_as("levers9 runs: error", 2)
def _clean(args: argparse.Namespace) -> int:
    keep = args.keep
    if keep is None and args.older_than is None:
        keep = run_folder.keep_runs()
    removed = run_folder.clean(keep=keep, older_than=args.older_than)
    kept, skipped = run_reader.scan_runs()
    _say_skipped(skipped)
    print(f"removed {len(removed)} run folder(s) from {runs_dir()}; {len(kept)} kept")
    return 0


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Columns padded to their widest cell; the last column is never padded."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        cells = [str(c).ljust(w) for c, w in zip(row[:-1], widths, strict=True)] + [str(row[-1])]
        print("  ".join(cells).rstrip())


def _counts(cells: Sequence[run_reader.CellState]) -> tuple[int, int, int]:
    """(done, failed, total) of `cells`."""
    states = [cell.state for cell in cells]
    return states.count("done"), states.count("failed"), len(states)


def _when(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))
