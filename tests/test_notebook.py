"""`distributed.run` and `@job` from a real Jupyter kernel, and from `python -c` after torch was used.

Each notebook scenario runs in one kernel (nbclient + ipykernel, the venv's interpreter, a kernelspec
and every Jupyter/IPython folder in a tmp dir): the committed example notebook with a small config,
then a sweep with `@job(...).map` on simulated cards, and checks that nothing is left running.
"fork" is the default on a CPU box; "spawn" sets LEVERS9_START_METHOD=spawn
in the kernel's environment, which is what happens when the kernel has already initialised CUDA:
fresh interpreters, with the notebook-defined functions and their config shipped by value.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbformat import NotebookNode
from nbformat.v4 import new_code_cell

from tests.conftest import strip_launcher_env
from tests.proc_util import children_of, wait_gone

pytestmark = [pytest.mark.notebook, pytest.mark.xdist_group("notebook")]

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "notebook_quickstart.ipynb"
CELL_TIMEOUT_S = 180
SMALL_CFG = {"rows": 16, "features": 4, "steps": 5, "lr": 0.1}

# Appended after the quickstart's train_one_rank: the same function, also saying where it ran.
PROBE = """\
_train_as_written = train_one_rank


def train_one_rank(cfg):
    import os, sys
    out = _train_as_written(cfg)
    out["kernel_copy"] = "ipykernel" in sys.modules  # True only in a process forked from this kernel
    out["pid"] = os.getpid()
    return out
"""

KERNEL_PID = 'import os, sys\nprint("KERNEL_PID", os.getpid(), sys.executable)'

# Live children of the kernel (waiting up to 5 s for any on their way out), with their command lines.
LEFT_RUNNING = """\
import json, os
from tests.proc_util import children_of, wait_gone


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


print("LEFT " + json.dumps({p: _cmdline(p) for p in wait_gone(children_of(os.getpid()), 5.0)}))
"""

SWEEP = """\
import os, sys
from levers9 import job


@job(gpu="RTXPro6000", gpu_count=1)
def sweep_cell(lora_r, lr):
    print(f"lora_r={lora_r} on card {os.environ['CUDA_VISIBLE_DEVICES']}")
    return {
        "lora_r": lora_r,
        "lr": lr,
        "card": os.environ["CUDA_VISIBLE_DEVICES"],
        "kernel_copy": "ipykernel" in sys.modules,
    }


results = list(sweep_cell.map([(8, 1e-4), (16, 1e-4), (32, 2e-4), {"lora_r": 64, "lr": 2e-4}]))
results
"""

OPEN_FILE_IN_CFG = (
    'log_file = open("train.log", "w")\ndist.run(train_one_rank, {**cfg, "log": log_file}, nprocs=2)'
)
LOCK_IN_CFG = 'import threading\ndist.run(train_one_rank, {**cfg, "lock": threading.Lock()}, nprocs=2)'

RANK_RAISES = """\
def fails_on_rank_1(cfg):
    if dist.rank() == 1:
        raise ValueError(f"bad batch {cfg['batch']}")
    return "rank 0 finished"


dist.run(fails_on_rank_1, {"batch": 7}, nprocs=2)
"""

# Ranks that would sleep for two minutes: the test interrupts the kernel (the notebook's stop button) instead.
INTERRUPTED = """\
def sleeps(cfg):
    import time
    print(f"rank {dist.rank()} sleeping", flush=True)
    open(f"sleeping-{dist.rank()}", "w").close()  # the test interrupts once every rank got here
    time.sleep(120)


dist.run(sleeps, None, nprocs=2)
"""

# A file open for reading: cloudpickle would copy its contents into an io.StringIO instead of failing.
READ_FILE_IN_CFG = """\
with open("data.txt", "w") as f:
    f.write("0,1\\n")
data_file = open("data.txt")
dist.run(train_one_rank, {**cfg, "data": data_file}, nprocs=2)
"""

SCENARIOS: dict[str, dict[str, str]] = {
    "fork": {},
    "spawn": {"LEVERS9_START_METHOD": "spawn"},
}


@dataclasses.dataclass
class Executed:
    """A notebook after one kernel ran it: its code cells by id, how long it took, what outlived the kernel."""

    cells: dict[str, NotebookNode]
    seconds: float
    leftover: list[int]

    def errors(self, cell_id: str) -> list[str]:
        return [f"{o.ename}: {o.evalue}" for o in self.cells[cell_id].outputs if o.output_type == "error"]

    def stream(self, cell_id: str, name: str = "stdout") -> str:
        outs = self.cells[cell_id].outputs
        return "".join(o.text for o in outs if o.output_type == "stream" and o.name == name)

    def value(self, cell_id: str) -> Any:
        """The cell's execute_result, read back as a Python literal."""
        results = [o for o in self.cells[cell_id].outputs if o.output_type == "execute_result"]
        assert results, f"cell {cell_id} has no result; errors: {self.errors(cell_id)}"
        return ast.literal_eval(results[0].data["text/plain"])

    def left_running(self, cell_id: str) -> dict[str, str]:
        match = re.search(r"^LEFT (.*)$", self.stream(cell_id), re.M)
        assert match, f"cell {cell_id} printed no LEFT line; errors: {self.errors(cell_id)}"
        found: dict[str, str] = json.loads(match.group(1))
        return found


def _cell(source: str, cell_id: str) -> NotebookNode:
    cell = new_code_cell(source)
    cell["id"] = cell_id
    return cell


def _insert_after(nb: NotebookNode, cell_id: str, new: NotebookNode) -> None:
    index = next(i for i, c in enumerate(nb.cells) if c.get("id") == cell_id)
    nb.cells.insert(index + 1, new)


def scenario_notebook(name: str) -> NotebookNode:
    """The quickstart with a small cfg and a probe, then the scenario's own cells."""
    nb = nbformat.read(QUICKSTART, as_version=4)
    _insert_after(nb, "parameters", _cell(f"cfg = {SMALL_CFG!r}", "test-cfg"))
    _insert_after(nb, "train-one-rank", _cell(PROBE, "test-probe"))
    nb.cells.insert(0, _cell(KERNEL_PID, "test-kernel-pid"))
    nb.cells.append(_cell(LEFT_RUNNING, "left-after-run"))
    if name == "fork":
        nb.cells.append(_cell(RANK_RAISES, "rank-raises"))
        nb.cells.append(_cell(LEFT_RUNNING, "left-after-failure"))
        nb.cells.append(_cell(INTERRUPTED, "interrupted"))
        nb.cells.append(_cell(LEFT_RUNNING, "left-after-interrupt"))
    if name == "spawn":
        nb.cells.append(_cell(OPEN_FILE_IN_CFG, "cfg-open-file"))
        nb.cells.append(_cell(LOCK_IN_CFG, "cfg-lock"))
        nb.cells.append(_cell(READ_FILE_IN_CFG, "cfg-read-file"))
        nb.cells.append(_cell(LEFT_RUNNING, "left-after-unshippable"))
        nb.cells.append(_cell("log_file.close()\ndata_file.close()", "close-files"))
    nb.cells.append(_cell(SWEEP, "sweep"))
    nb.cells.append(_cell(LEFT_RUNNING, "left-after-sweep"))
    nbformat.validate(nb)
    return nb


def kernel_env(workdir: Path, extra: dict[str, str]) -> dict[str, str]:
    """A clean environment for the kernel: no launcher variables, every folder it writes in `workdir`."""
    env = dict(os.environ)
    strip_launcher_env(env)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
            "IPYTHONDIR": str(workdir / "ipython"),
            "JUPYTER_CONFIG_DIR": str(workdir / "jupyter-config"),
            "JUPYTER_DATA_DIR": str(workdir / "jupyter-data"),
            "JUPYTER_RUNTIME_DIR": str(workdir / "jupyter-runtime"),
            "LEVERS9_CONFIG_DIR": str(workdir / "levers9-config"),
            "LEVERS9_STATE_DIR": str(workdir / "levers9-state"),
            "LEVERS9_SIMULATE_GPUS": "RTXPro6000:2",
            **extra,
        }
    )
    return env


def _interrupt_once_ranks_run(km: KernelManager, workdir: Path, ranks: int) -> None:
    """Interrupt the kernel (as the notebook's stop button does) once each of `ranks` ranks is inside fn."""
    end = time.monotonic() + 60
    while len(list(workdir.glob("sleeping-*"))) < ranks and time.monotonic() < end:
        time.sleep(0.05)
    km.interrupt_kernel()


def execute(nb: NotebookNode, workdir: Path, env: dict[str, str]) -> Executed:
    """Run every cell of `nb` in one fresh kernel on this interpreter (errors are kept as outputs), then stop it.

    The cell with id "interrupted" is interrupted once its two ranks run.
    """
    spec_dir = workdir / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps({**spec, "display_name": "levers9 test kernel"}))
    km = KernelManager(
        kernel_name="python3",
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(workdir / "kernels")]),
        connection_file=str(workdir / "connection.json"),
    )
    interrupters: list[threading.Thread] = []

    def on_cell_execute(cell: NotebookNode, cell_index: int) -> None:
        if cell.get("id") == "interrupted":
            interrupters.append(threading.Thread(target=_interrupt_once_ranks_run, args=(km, workdir, 2), daemon=True))
            interrupters[-1].start()

    client = NotebookClient(
        nb,
        km=km,
        on_cell_execute=on_cell_execute,
        timeout=CELL_TIMEOUT_S,
        allow_errors=True,
        resources={"metadata": {"path": str(workdir)}},
    )
    before = set(children_of(os.getpid()))
    started = time.monotonic()
    try:
        client.execute(env=env)
    finally:
        for thread in interrupters:
            thread.join(timeout=60)
        if km.has_kernel:  # nbclient leaves a kernel it did not create running
            km.shutdown_kernel(now=False)
    seconds = time.monotonic() - started
    leftover = wait_gone([p for p in children_of(os.getpid()) if p not in before], 5.0)
    cells = {c["id"]: c for c in nb.cells if c.cell_type == "code"}
    return Executed(cells, seconds, leftover)


@pytest.fixture(scope="module")
def notebook_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Executed]]:
    """Executes each scenario's notebook once (one kernel each) and hands the same result to every test."""
    done: dict[str, Executed] = {}

    def get(name: str) -> Executed:
        if name not in done:
            workdir = tmp_path_factory.mktemp(f"notebook-{name}")
            done[name] = execute(scenario_notebook(name), workdir, kernel_env(workdir, SCENARIOS[name]))
            print(f"notebook scenario {name!r}: {done[name].seconds:.1f} s in one kernel")
        return done[name]

    yield get


# Near 20 s in the three-worker suite (15 s on 2026-12-04, about 8 s alone on 2 idle cores): each scenario
# starts a Jupyter kernel that imports torch and runs the scenario's notebook, in the first test that reads
# it ([spawn]: every run's ranks are fresh interpreters, each importing torch again).
@pytest.mark.parametrize("scenario", ["fork", "spawn"])
def test_run_from_notebook_returns_rank0_result_and_shows_every_rank(
    notebook_run: Callable[[str], Executed], scenario: str
) -> None:
    nb = notebook_run(scenario)
    assert nb.errors("run-two-ranks") == []
    result = nb.value("run-two-ranks")
    assert result["world_size"] == 2
    # fork: the ranks are copies of the kernel; spawn: fresh interpreters that got train_one_rank by value
    assert result["kernel_copy"] is (scenario == "fork")
    kernel_pid, executable = nb.stream("test-kernel-pid").split()[1:]
    assert executable == sys.executable  # the kernel runs this venv's interpreter
    assert result["pid"] != int(kernel_pid)

    rows = SMALL_CFG["rows"] // 2
    lines = nb.stream("run-two-ranks").splitlines()
    assert f"rank 0 of 2: {rows} rows on cpu" in lines  # rank 0 unprefixed
    assert f"[rank 1] rank 1 of 2: {rows} rows on cpu" in lines
    done = [line for line in lines if "done: loss" in line]
    assert done == [f"done: loss {result['loss']:.4f} (mean over 2 ranks)"]  # print0: once, from rank 0
    assert "Traceback" not in nb.stream("run-two-ranks", "stderr")

    # Two DDP ranks on equal halves take the same steps as one rank on all rows (world of one, in the kernel).
    assert nb.errors("run-world-of-one") == []
    alone = nb.value("run-world-of-one")
    assert alone["world_size"] == 1
    assert alone["loss"] == pytest.approx(result["loss"], rel=1e-4, abs=1e-6)


def test_unshippable_cfg_in_notebook_names_the_part_and_starts_nothing(
    notebook_run: Callable[[str], Executed],
) -> None:
    nb = notebook_run("spawn")
    assert nb.errors("run-two-ranks") == []  # the same kernel ran the real thing first
    (open_file,) = nb.errors("cfg-open-file")
    assert open_file.startswith("NotShippableError: ")
    assert "cfg['log']" in open_file
    assert "TextIOWrapper" in open_file
    (lock,) = nb.errors("cfg-lock")
    assert lock.startswith("NotShippableError: ")
    assert "cfg['lock']" in lock
    assert "lock" in lock.lower()
    assert nb.left_running("left-after-unshippable") == {}


def test_file_open_for_reading_in_cfg_is_refused_too(notebook_run: Callable[[str], Executed]) -> None:
    nb = notebook_run("spawn")
    (error,) = nb.errors("cfg-read-file")
    assert error.startswith("NotShippableError: ") and "cfg['data']" in error


def test_rank_failure_in_notebook_shows_the_original_error_and_the_rank(
    notebook_run: Callable[[str], Executed],
) -> None:
    nb = notebook_run("fork")
    assert nb.errors("rank-raises") == ["ValueError: bad batch 7"]
    (error,) = [o for o in nb.cells["rank-raises"].outputs if o.output_type == "error"]
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error.traceback))
    assert "raised on rank 1" in shown  # the note the library adds, as the notebook displays it
    assert "fails_on_rank_1" in shown  # the rank's own traceback
    assert nb.left_running("left-after-failure") == {}


def test_interrupting_the_kernel_stops_every_rank(notebook_run: Callable[[str], Executed]) -> None:
    nb = notebook_run("fork")
    assert nb.errors("interrupted") == ["KeyboardInterrupt: "]
    lines = nb.stream("interrupted").splitlines()
    assert "rank 0 sleeping" in lines and "[rank 1] rank 1 sleeping" in lines
    timing = nb.cells["interrupted"].metadata["execution"]
    took = _seconds_between(timing["iopub.execute_input"], timing["shell.execute_reply"])
    assert took < 60  # the ranks would sleep 120 s
    assert nb.left_running("left-after-interrupt") == {}


def _seconds_between(start: str, end: str) -> float:
    from datetime import datetime

    return (
        datetime.fromisoformat(end.replace("Z", "+00:00"))
        - datetime.fromisoformat(start.replace("Z", "+00:00"))
    ).total_seconds()


@pytest.mark.parametrize("scenario", ["fork", "spawn"])
def test_job_map_from_notebook_in_input_order(notebook_run: Callable[[str], Executed], scenario: str) -> None:
    nb = notebook_run(scenario)
    assert nb.errors("sweep") == []
    results = nb.value("sweep")
    assert [r["lora_r"] for r in results] == [8, 16, 32, 64]
    assert [r["lr"] for r in results] == [1e-4, 1e-4, 2e-4, 2e-4]
    assert {r["card"] for r in results} <= {"0", "1"}
    # fork: jobs are copies of the kernel; exec: fresh interpreters that got sweep_cell by value
    assert {r["kernel_copy"] for r in results} == {scenario == "fork"}
    shown = re.findall(r"^\[sweep_cell #(\d)\] lora_r=(\d+) on card ([01])$", nb.stream("sweep"), re.M)
    assert sorted((int(i), int(r)) for i, r, _ in shown) == [(0, 8), (1, 16), (2, 32), (3, 64)]
    assert {(int(i), card) for i, _, card in shown} == {(i, r["card"]) for i, r in enumerate(results)}


@pytest.mark.parametrize("scenario", ["fork", "spawn"])
def test_notebook_leaves_nothing_running(notebook_run: Callable[[str], Executed], scenario: str) -> None:
    nb = notebook_run(scenario)
    assert nb.left_running("left-after-run") == {}
    assert nb.left_running("left-after-sweep") == {}
    assert nb.leftover == []  # the kernel itself is gone too


MAIN_AFTER_TORCH = """
import json, os, sys
import torch
from levers9 import distributed as dist
from tests.proc_util import children_of, wait_gone

SCALE = torch.ones(3) * 2  # torch used in the caller before distributed.run
assert float(SCALE @ SCALE) == 12.0
CALLER_MARK = "only in the caller's __main__"


def fn(cfg):
    value = dist.all_reduce_mean(SCALE.sum() * (dist.rank() + cfg["offset"])).item()
    print(f"rank {dist.rank()} of {dist.world_size()}: mean {value}")
    return {
        "mean": value,
        "world_size": dist.world_size(),
        "pid": os.getpid(),
        "caller_main": hasattr(sys.modules["__main__"], "CALLER_MARK"),
    }


out = dist.run(fn, {"offset": 1}, nprocs=2)
out["caller_pid"] = os.getpid()
out["left"] = wait_gone(children_of(os.getpid()), 5.0)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("start_method", [None, "spawn"])
def test_fn_in_main_after_torch_was_used(start_method: str | None) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    if start_method is not None:
        env["LEVERS9_START_METHOD"] = start_method
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MAIN_AFTER_TORCH)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"^RESULT (.*)$", proc.stdout, re.M)
    assert match, proc.stdout + proc.stderr
    out = json.loads(match.group(1))
    assert out["mean"] == pytest.approx(9.0)  # mean of 6 * 1 and 6 * 2
    assert out["world_size"] == 2
    assert out["pid"] != out["caller_pid"]
    # default (fork): rank 0 is a copy of the caller; spawn: a fresh interpreter that got fn by value
    assert out["caller_main"] is (start_method is None)
    assert out["left"] == []
    lines = proc.stdout.splitlines()
    assert "rank 0 of 2: mean 9.0" in lines
    assert "[rank 1] rank 1 of 2: mean 9.0" in lines
