"""One benchmark, this checkout against another (the code before a change), side by side in one run.

    git worktree add /tmp/before <commit>
    python benchmarks/bench_trees.py /tmp/before --rounds 3 -- python benchmarks/bench_helpers.py --rounds 3
    python benchmarks/bench_trees.py /tmp/before --rounds 3 -- python benchmarks/bench_sweep.py --repeat 1
    python benchmarks/bench_trees.py /tmp/before --rounds 2 -- \\
        python benchmarks/bench_ray_train.py --tools levers9 --repeats 1 --scenarios start,raise,kill,restart

The command after `--` runs once a round under each checkout: its levers9 first on PYTHONPATH and its
folder the working directory (the benchmark script is this checkout's for both: only the package
differs), in an order that alternates round by round so machine noise hits both alike. Both trees are
compiled to bytecode first, as an installed package is (precompiled.py). Every row of the tables the
command prints is read (a markdown row `| name | 1.23 s |`, or a row of a name then numbers,
`cells 1.23 0.90`): for each row and each of its numbers, the table gives the median over the rounds
under each checkout and their ratio. Rows printed in only one tree's output are left out.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from precompiled import precompile

HERE = Path(__file__).resolve().parent
NUMBER = re.compile(r"^[>~<]?\s*(-?\d+(?:\.\d+)?)\s*(?:x|s|ms|us|%)?$")

Rows = dict[tuple[str, int], list[float]]


def read_rows(output: str) -> Rows:
    """{(row name, number's position in the row): [the number]} for every table row of `output`."""
    rows: Rows = {}
    for line in output.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            name, values = cells[0], cells[1:]
        else:
            words = line.split()
            first = next((i for i, w in enumerate(words) if NUMBER.match(w)), None)
            if not first:  # no number, or a line that starts with one: not a row
                continue
            name, values = " ".join(words[:first]), words[first:]
        for position, value in enumerate(values):
            found = NUMBER.match(value.split(" (")[0])  # "1.23 s (1.1-1.4)": the median
            if found and name and not name.startswith("-"):
                rows.setdefault((name, position), []).append(float(found.group(1)))
    return rows


def run_once(tree: Path, command: list[str], cwd: Path | None = None) -> str:
    """The command's output, run with `tree`'s levers9; SystemExit with its output when it fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} with PYTHONPATH={tree} exited with {done.returncode}:\n"
                         f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")  # fmt: skip
    return done.stdout


def check_tree(tree: Path) -> None:
    """SystemExit unless `import levers9` under this tree's PYTHONPATH loads that tree's package."""
    probe = [sys.executable, "-c", "import levers9; print(levers9.__file__)"]
    loaded = Path(run_once(tree, probe, cwd=HERE).strip()).resolve()  # not from a cwd holding another levers9
    if not loaded.is_relative_to(tree.resolve()):
        raise SystemExit(f"PYTHONPATH={tree} imports levers9 from {loaded}; expected a levers9 checkout at {tree} "
                         f"(e.g. `git worktree add {tree} <commit>`)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path, help="a checkout of the code to compare against (e.g. a git worktree)")
    parser.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]  # the benchmark's own flags stay its own
    if not command:
        raise SystemExit("no benchmark command; expected it after `--`, e.g. -- python benchmarks/bench_helpers.py")
    trees = {"this checkout": HERE.parent, "before": args.before}
    for tree in trees.values():
        check_tree(tree)
        precompile(tree)
    # the benchmark's files from this checkout, whichever tree runs; each tree runs in its own folder, which Ray
    # puts first on its workers' sys.path (a worker must import the tree's levers9 as the driver does)
    command = [str((HERE.parent / word).resolve()) if (HERE.parent / word).is_file() else word for word in command]
    rows: dict[str, Rows] = {name: {} for name in trees}
    for number in range(args.rounds):
        for name in list(trees) if number % 2 == 0 else list(trees)[::-1]:
            for key, values in read_rows(run_once(trees[name], command, cwd=trees[name])).items():
                rows[name].setdefault(key, []).extend(values)
            print(f"round {number + 1}, {name}: done", file=sys.stderr, flush=True)
    print(f"`{' '.join(command)}`: median of {args.rounds} rounds under each checkout, interleaved; "
          f"{os.cpu_count()} cores")  # fmt: skip
    print()
    print("| row (number) | this checkout | before | this / before |")
    print("| --- | --- | --- | --- |")
    for key, ours in rows["this checkout"].items():
        theirs = rows["before"].get(key)
        if not theirs:
            continue
        a, b = statistics.median(ours), statistics.median(theirs)
        ratio = f"{a / b:.2f}x" if b else "-"
        print(f"| {key[0]} ({key[1] + 1}) | {a:g} | {b:g} | {ratio} |")


if __name__ == "__main__":
    main()
