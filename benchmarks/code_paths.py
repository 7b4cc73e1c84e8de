"""What a reader holds to follow `distributed.run(fn, cfg, nprocs=2)` and `cell.map(grid)` end to end.

    python benchmarks/code_paths.py [TREE ...]      # each TREE a checkout (default: this one)

For each checkout (put first on PYTHONPATH; the probe runs in a folder of its own, so the current one never
shadows it), runs each call for real in a process of its own that imports only what that call needs (2 gloo
ranks; a 4-cell map on 4 simulated cards) and counts the levers9 modules loaded in the caller and in the children: the files
the data passes through. Prints files, lines (wc -l) and code lines (no blank, comment or docstring
lines) for each; then, by package folder (a call's own layer: distributed and procs for `run`, launch
for `.map`), the functions that ran in the caller and the processes it forked (a profile hook records
every levers9 function called): what a reader opens to follow the call, counted the same way for every
checkout; then the package's classes that share a name. Not a timing: a size, counted the same
way for every checkout.
"""

from __future__ import annotations

import argparse
import ast
import collections
import io
import json
import os
import subprocess
import sys
import tempfile
import tokenize
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LAYERS = ("distributed", "procs", "launch", "top level")

PROBE = r"""
import json, os, sys, threading
sys.path.insert(0, os.environ["PROBE_DIR"])
ran = set()  # (file, first line, last line) of every levers9 function called, in this process and its forks

def note_call(frame, event, arg):
    code = frame.f_code
    if event == "call" and "/levers9/" in code.co_filename and code.co_name != "<module>":
        ran.add((code.co_filename, code.co_firstlineno, max(line or 0 for _, _, line in code.co_lines())))

def dump_and_exit(status, _exit=os._exit):  # a forked rank or job process leaves through os._exit
    with open(os.path.join(os.environ["PROBE_DIR"], f"ran-{os.getpid()}.json"), "w") as out:
        json.dump(sorted(ran), out)
    _exit(status)

os._exit = dump_and_exit
sys.setprofile(note_call)
threading.setprofile(note_call)
import probe_fns
which = sys.argv[1]
if which == "run":  # each call loads only its own layer, as a script that makes only that call does
    from levers9 import distributed
else:
    from levers9 import job

def loaded():
    return sorted(m.__file__ for m in list(sys.modules.values()) if m.__name__.startswith("levers9") and getattr(m, "__file__", None))

if which == "run":
    child = distributed.run(probe_fns.rank_modules, None, nprocs=2)
else:
    cell = job(gpu="RTXPro6000", gpu_count=1, stream_output=False)(probe_fns.cell_modules)
    child = sorted({f for files in cell.map([(i,) for i in range(4)]) for f in files})
sys.setprofile(None)
threading.setprofile(None)
for name in os.listdir(os.environ["PROBE_DIR"]):
    if name.startswith("ran-"):
        ran.update(tuple(f) for f in json.load(open(os.path.join(os.environ["PROBE_DIR"], name))))
print(json.dumps({"loaded": sorted(set(loaded()) | set(child)), "ran": sorted(ran)}))
"""

FNS = r"""
import sys

def _loaded():
    return sorted(m.__file__ for m in list(sys.modules.values()) if m.__name__.startswith("levers9") and getattr(m, "__file__", None))

def rank_modules(cfg=None):
    from levers9 import distributed as dist
    dist.all_reduce_mean(1.0)
    return _loaded()

def cell_modules(i):
    return _loaded()
"""


def code_lines(text: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    doc_lines: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                doc_lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    return len(code - doc_lines)


def path_of(tree: str, which: str) -> dict[str, list[Any]]:
    """{"loaded": levers9 files loaded in the caller and children, "ran": [file, first, last line] of every
    levers9 function called in the caller and in the processes it forked}."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "probe_fns.py").write_text(FNS)
        env = {**os.environ, "PYTHONPATH": tree, "PROBE_DIR": tmp, "LEVERS9_SIMULATE_GPUS": "RTXPro6000:4",
               "LEVERS9_CONFIG_DIR": tmp, "LEVERS9_STATE_DIR": tmp, "OMP_NUM_THREADS": "1"}  # fmt: skip
        done = subprocess.run([sys.executable, "-c", PROBE, which], env=env, cwd=tmp, capture_output=True, text=True, timeout=300)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the {which} probe failed in {tree}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def layer_of(tree: str, path: str) -> str:
    """The package folder a file belongs to: distributed, procs, launch, or the package's top level."""
    parts = Path(path).relative_to(Path(tree).resolve() / "levers9").parts
    return parts[0] if len(parts) > 1 else "top level"


def ran_by_layer(tree: str, ran: list[list[Any]]) -> dict[str, tuple[int, int]]:
    """{layer: (files, lines)} of the functions that ran: the lines of each function that was called (from
    its `def` to its last line, nested ones counted once), the files holding them."""
    lines: dict[str, set[int]] = collections.defaultdict(set)
    for path, first, last in ran:
        lines[path].update(range(first, last + 1))
    layers: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for path, numbers in lines.items():
        layer = layers[layer_of(tree, path)]
        layer[0] += 1
        layer[1] += len(numbers)
    return {name: (files, count) for name, (files, count) in sorted(layers.items())}


def shared_class_names(tree: str) -> dict[str, list[str]]:
    names: dict[str, list[str]] = collections.defaultdict(list)
    for path in sorted(Path(tree, "levers9").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names[node.name.lstrip("_")].append(str(path.relative_to(tree)))
    return {name: paths for name, paths in names.items() if len(paths) > 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="*", default=[str(HERE.parent)])
    args = parser.parse_args()
    print("| checkout | call | files | lines | code lines |\n| --- | --- | --- | --- | --- |")
    ran: dict[tuple[str, str], dict[str, tuple[int, int]]] = {}
    for tree in args.trees:
        for which in ("run", "map"):
            found = path_of(tree, which)
            texts = [Path(f).read_text() for f in found["loaded"]]
            lines = sum(t.count("\n") for t in texts)
            print(f"| {tree} | {which} | {len(texts)} | {lines} | {sum(code_lines(t) for t in texts)} |")
            ran[tree, which] = ran_by_layer(tree, found["ran"])
    print("\nThe functions that ran (caller and forked children), by package folder: files, lines from def to end")
    print("| checkout | call | files in all | " + " | ".join(LAYERS) + " |\n| --- | --- | --- |" + " --- |" * len(LAYERS))
    for (tree, which), layers in ran.items():
        cells = (f"{layers[name][0]} files, {layers[name][1]} lines" if name in layers else "-" for name in LAYERS)
        total = sum(files for files, _ in layers.values())
        print(f"| {tree} | {which} | {total} | " + " | ".join(cells) + " |")
    for tree in args.trees:
        shared = shared_class_names(tree)
        print(f"\n{tree}: {len(shared)} class name(s) shared: " + "; ".join(f"{n} ({', '.join(p)})" for n, p in sorted(shared.items())))


if __name__ == "__main__":
    main()
