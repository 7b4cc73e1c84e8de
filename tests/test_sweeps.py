"""Sweeps people can watch, resume and look back on: scale, completion order, resume, the status
table and plain lines, and `levers9 runs` with its retention. Cells run on 4 simulated cards."""

from __future__ import annotations

import gc
import importlib
import importlib.util
import json
import os
import pty
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest

from levers9.cli import main as cli_main
from levers9.errors import InfeasibleJobError, JobConfigError
from levers9.launch import job, run_folder, run_reader
from levers9.launch.cells import Cell
from levers9.launch.settings import runs_dir, update_settings
from levers9.procs.watch import pid_alive
from tests import jobfns, ray_cluster

pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def four_cards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:4")


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


def _wait_for(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def _runs_of(folder: Path) -> dict[int, int]:
    """How many times each cell body ran, from the lines jobfns.counted wrote."""
    return {int(p.stem): len(p.read_text().splitlines()) for p in folder.glob("*.runs")}


# ---- scale ----------------------------------------------------------------------------------------


# A user's sweep script: the sweep runs in a process of its own (not in pytest's, whose size would make
# every fork slow) and reports the peaks of its own /proc/self/fd and thread count while it ran.
THOUSANDS_SCRIPT = """
import json, os, sys, threading, time
from levers9 import job
from tests import jobfns

fn = job(gpu="RTXPro6000", stream_output=False)(jobfns.add)
list(fn.map(range(4), progress=False))  # the forker thread and the lifeline start with the first cells
base = {"fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count()}
peak = dict(base)
stop = threading.Event()

def sample():
    while not stop.is_set():
        peak["fds"] = max(peak["fds"], len(os.listdir("/proc/self/fd")))
        peak["threads"] = max(peak["threads"], threading.active_count())
        time.sleep(0.005)

sampler = threading.Thread(target=sample)
sampler.start()
started = time.monotonic()
results = list(fn.map(range(int(sys.argv[1])), progress=False))
stop.set()
sampler.join()
print(json.dumps({"base": base, "peak": peak, "ok": results == list(range(int(sys.argv[1]))),
                  "seconds": time.monotonic() - started}))
"""


# Over 20 s on 2 busy cores (about 15 s idle): 1,000 real job processes, so a descriptor or a thread left
# behind by one cell in ten shows as 100, twice the bound the lanes' own need.
@pytest.mark.timeout(300)
def test_a_thousand_cells_run_with_bounded_descriptors_and_threads(tmp_path: Path) -> None:
    cells = 1000
    done = subprocess.run(
        [sys.executable, "-c", THOUSANDS_SCRIPT, str(cells)], cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ok"], report
    grew = {what: report["peak"][what] - report["base"][what] for what in ("fds", "threads")}
    # 4 lanes, each with at most a lease ticket or a running job: its 3 pipes (both ends while it starts),
    # its watcher's wake pipe, a pidfd, a selector, 2 log files, and its card's lock in each lease folder
    # (this caller's, and the fallback /tmp/levers9-<uid>/leases where an earlier run without a state
    # folder left one, as on the machine where CI saw 56); plus the run's events file and its claim.
    # Traced peaks: 48 to 53 with one lease folder, 54 to 56 with both; 56 is 4 lanes of 14 less those not
    # yet opened. A descriptor left by one cell in ten would show as 100.
    assert grew["fds"] <= 4 * 14 + 2, report
    assert grew["threads"] <= 4 + 2, report  # 4 lanes and the sampler


# Over 20 s in the three-worker suite (about 8 s alone on 2 idle cores): 204 real Ray tasks, each starting
# its cell's job process, four at a time on the session Ray's four logical cards.
@pytest.mark.ray
@pytest.mark.timeout(240)
def test_a_big_sweep_on_ray_runs_on_lanes_not_a_thread_per_cell(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address(request.config))
    cells = 200
    fn = job(gpu="RTXPro6000", backend="ray", stream_output=False)(jobfns.add)
    list(fn.map(range(4), progress=False))  # Ray's own client threads start with the first tasks
    base_threads = threading.active_count()
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, threading.active_count())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        results = list(fn.map(range(cells), progress=False))
    finally:
        stop.set()
        sampler.join()
    assert results == list(range(cells))
    # 8 lanes (twice the cluster's 4 one-card tasks at once) and the sampler, not one thread per cell.
    assert peak - base_threads <= 2 * ray_cluster.CARDS + 4, (peak, base_threads)


# A map holds only what the caller has not read: each result (a value, or with return_exceptions a cell's
# exception) is let go once yielded, as ProcessPoolExecutor.map does, so a long sweep's memory is what
# the caller itself keeps (before, every result of a 5,000-cell map stayed until the map was dropped).
# benchmarks/bench_map_memory.py measures the caller's peak over 10,000 cells. The first 8 cells end at
# once; the last 4 hold the 4 lanes until the gate opens, so once they started no lane holds one of the
# first 8 (a lane lets a cell go when it takes the next), and the map, still open, is all that could.
@pytest.mark.timeout(180)
@pytest.mark.parametrize("order", ["input", "completed"])
def test_a_result_is_let_go_once_it_was_yielded(order: str, tmp_path: Path) -> None:
    size, failing, gate = 1 << 20, 4, tmp_path / "gate"  # every 4th cell raises, its exception carrying 1 MB too
    fn = job(gpu="RTXPro6000", stream_output=False)(jobfns.payload_or_fail)
    cells = [(i, size, failing) for i in range(8)] + [(i, size, failing, str(gate)) for i in range(8, 12)]
    results = fn.map(cells, order=order, return_exceptions=True, progress=False)
    read: dict[int, weakref.ref[Any]] = {}
    raised: set[int] = set()

    def read_one() -> None:
        item = next(results)
        index, value = item if order == "completed" else (len(read), item)
        payload = value.args[1] if isinstance(value, jobfns.CellError) else value
        assert isinstance(payload, jobfns.Payload) and payload.index == index and len(payload.data) == size
        if isinstance(value, jobfns.CellError):
            raised.add(index)
        read[index] = weakref.ref(payload)

    for _ in range(8):
        read_one()
    assert sorted(read) == list(range(8))
    _wait_for(lambda: all(Path(f"{gate}-started-{i}").exists() for i in range(8, 12)), "the 4 gated cells to start")
    held = [i for i, ref in read.items() if i not in raised and ref() is not None]
    assert not held, f"values {held} are still held after they were yielded ({order} order, the map still open)"
    gc.collect()  # an exception's traceback holds the frames that raised it, which hold it: a cycle
    held = [i for i, ref in read.items() if ref() is not None]
    assert not held, f"exceptions {held} are still held after they were yielded ({order} order, the map still open)"
    gate.write_text("go")
    for _ in range(4):
        read_one()
    assert list(results) == [] and len(results) == 12
    assert raised == {i for i in range(12) if i % failing == failing - 1}


# An exception in the caller's loop, the map still running: the interpreter's exit drops the map while its
# lanes no longer run. It used to wait for them there, forever; now the exit cancels the map and the
# cells end with the caller's lifeline.
LEAVES_MID_MAP_SCRIPT = """
import sys
from levers9 import job
from tests import jobfns

fn = job(gpu="RTXPro6000", stream_output=False)(jobfns.payload_or_fail)
results = fn.map([(0, 10, 0)] + [(i, 10, 0, sys.argv[1]) for i in range(1, 4)], progress=False)
for value in results:
    raise RuntimeError("the caller's own bug, with cells still running")
"""


@pytest.mark.timeout(120)
def test_an_exception_in_the_callers_loop_exits_and_ends_the_running_cells(tmp_path: Path) -> None:
    gate = tmp_path / "gate"  # never opened: cells 1 to 3 run until they are stopped
    done = subprocess.run([sys.executable, "-c", LEAVES_MID_MAP_SCRIPT, str(gate)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=100)  # fmt: skip
    assert done.returncode == 1 and "the caller's own bug" in done.stderr, done.stderr
    pids = [int(p.read_text()) for p in tmp_path.glob("gate-started-*") if p.read_text()]
    _wait_for(lambda: not any(pid_alive(pid) for pid in pids), f"the cells' processes {pids} to end")


# ---- completion order -----------------------------------------------------------------------------


def _completion_order(tmp_path: Path, backend: str | None) -> None:
    gate = tmp_path / "gate"
    fn = job(gpu="RTXPro6000", backend=backend, stream_output=False)(jobfns.when_file_exists)
    results = fn.map([("slow", str(gate)), ("quick", None)], order="completed")
    first = next(results)
    assert (first.index, first.value) == (1, "quick")  # the quick cell, matched to its input
    gate.write_text("go")
    index, value = next(results)  # unpacks as a pair
    assert (index, value) == (0, "slow")
    assert list(results) == []


@pytest.mark.timeout(120)
def test_completed_order_yields_the_short_cell_first_with_its_index(tmp_path: Path) -> None:
    _completion_order(tmp_path, None)


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_completed_order_on_ray(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address(request.config))
    _completion_order(tmp_path, "ray")


@pytest.mark.timeout(60)
def test_completed_order_raises_the_first_failure_and_return_exceptions_keeps_it(tmp_path: Path) -> None:
    (tmp_path / "fail-1").write_text("")
    fn = job(gpu="RTXPro6000", stream_output=False)(jobfns.counted)
    got = dict(fn.map([(str(tmp_path), i) for i in range(3)], order="completed", return_exceptions=True))
    assert got[0] == 0 and got[2] == 20 and isinstance(got[1], jobfns.CellError)
    with pytest.raises(jobfns.CellError):
        list(fn.map([(str(tmp_path), i) for i in range(3)], order="completed"))


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_unknown_order_is_refused_before_anything_starts() -> None:
    fn = job(gpu="RTXPro6000")(jobfns.add)
    with pytest.raises(JobConfigError, match=r"order='fastest'.*'input', 'completed'"):
        fn.map([1, 2], order="fastest")  # type: ignore[call-overload]
    update_settings(multi_gpu=True)
    with pytest.raises(InfeasibleJobError):
        job(gpu="RTXPro6000", gpu_count=5)(jobfns.add).map([1, 2])
    assert not list(runs_dir().glob("*"))  # a refused sweep leaves no run folder


# ---- resume ---------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_resume_after_a_failed_cell_runs_only_that_cell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "fail-2").write_text("")
    fn = job(gpu="RTXPro6000", stream_output=False)(jobfns.counted)
    inputs = [(str(work), i) for i in range(5)]
    first = list(fn.map(inputs, return_exceptions=True))
    assert isinstance(first[2], jobfns.CellError)
    (work / "fail-2").unlink()
    capsys.readouterr()
    assert list(fn.map(inputs, resume=True)) == [0, 10, 20, 30, 40]
    assert "reused 4 of 5 cells" in capsys.readouterr().err
    assert _runs_of(work) == {0: 1, 1: 1, 2: 2, 3: 1, 4: 1}
    # changed inputs are new cells; the unchanged ones are still reused
    assert list(fn.map([*inputs, (str(work), 5)], resume=True)) == [0, 10, 20, 30, 40, 50]
    assert _runs_of(work) == {0: 1, 1: 1, 2: 2, 3: 1, 4: 1, 5: 1}
    # without resume=True every cell runs
    list(fn.map(inputs[:2]))
    assert _runs_of(work)[0] == 2


@pytest.mark.timeout(120)
def test_resume_reruns_cells_after_the_function_body_changed(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    module = tmp_path / "sweep_body.py"
    body = "from tests.jobfns import counted\n\ndef cell(folder, i):\n    return counted(folder, i) + {}\n"
    module.write_text(body.format(0))
    sys.path.insert(0, str(tmp_path))
    try:
        mod = importlib.import_module("sweep_body")
        assert list(job(gpu="RTXPro6000")(mod.cell).map([(str(work), 1)], resume=True)) == [10]
        assert list(job(gpu="RTXPro6000")(mod.cell).map([(str(work), 1)], resume=True)) == [10]
        assert _runs_of(work) == {1: 1}
        module.write_text(body.format(1))
        # The same size, maybe within the same second: the bytecode cache (keyed by size and whole seconds) looks fresh
        Path(importlib.util.cache_from_source(str(module))).unlink(missing_ok=True)
        mod = importlib.reload(mod)
        assert list(job(gpu="RTXPro6000")(mod.cell).map([(str(work), 1)], resume=True)) == [11]
        assert _runs_of(work) == {1: 2}
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("sweep_body", None)


@pytest.mark.timeout(60)
def test_resume_never_unpickles_results_from_a_folder_others_can_write(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    fn = job(gpu="RTXPro6000", stream_output=False)(jobfns.counted)
    results = fn.map([(str(work), 0)])
    assert list(results) == [0]
    assert results.run_id is not None
    (runs_dir() / results.run_id / "results").chmod(0o777)
    assert list(fn.map([(str(work), 0)], resume=True)) == [0]
    assert _runs_of(work) == {0: 2}


DRIVER = """
import sys
from levers9.launch import job
from tests import jobfns

fn = job(gpu="RTXPro6000", stream_output=False)(jobfns.counted)
for value in fn.map([(sys.argv[1], i) for i in range(12)], resume=True, progress=sys.argv[2] == "on"):
    print(value, flush=True)
"""


@pytest.mark.timeout(180)
def test_resume_after_the_caller_was_killed_mid_sweep(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    for i in range(4, 12):
        (work / f"hold-{i}").write_text("")  # cells 4.. wait: the caller is killed while they run
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(work), "off"], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        _wait_for(lambda: len(list(runs_dir().glob("*/results/*.pkl"))) == 4, "four stored results")
        # counted() makes its .runs file before it writes its line: wait for the lines, not the files
        _wait_for(lambda: sum(1 for n in _runs_of(work).values() if n) == 8, "cells 4 to 7 to start")
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    for i in range(4, 12):
        (work / f"hold-{i}").unlink()
    again = subprocess.run(
        [sys.executable, "-c", DRIVER, str(work), "on"], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.split() == [str(i * 10) for i in range(12)]
    assert "reused 4 of 12 cells" in again.stderr
    assert _runs_of(work) == {**{i: 1 for i in range(4)}, **{i: 2 for i in range(4, 8)}, **{i: 1 for i in range(8, 12)}}
    killed = [r for r in run_reader.list_runs() if r.status == "interrupted"]
    assert len(killed) == 1 and killed[0].counts() == (4, 0, 12)


TAGS_DRIVER = """
import dataclasses, sys
from levers9.launch import job
from tests import jobfns

@dataclasses.dataclass
class Config:  # made in __main__: cloudpickle copies its class by value, with a random tracker id
    tags: set

fn = job(gpu="RTXPro6000", stream_output=False)(jobfns.counted_with)
extra = ({"alpha", "beta", "gamma", "delta", "epsilon"}, Config({"lr", "wd", "warmup", "decay"}))
print(list(fn.map([(sys.argv[1], i, extra) for i in range(3)], resume=True, progress=False)))
"""


@pytest.mark.timeout(120)
def test_resume_finds_cells_whose_arguments_hold_sets_under_another_hash_seed(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    for seed in ("1", "2"):  # set iteration order follows the string hash seed
        done = subprocess.run([sys.executable, "-c", TAGS_DRIVER, str(work)], env=_env(PYTHONHASHSEED=seed),
                              capture_output=True, text=True, timeout=100)  # fmt: skip
        assert done.returncode == 0 and done.stdout.split("\n")[0] == "[0, 10, 20]", done.stderr
    assert _runs_of(work) == {0: 1, 1: 1, 2: 1}  # the second process reused every cell


@pytest.mark.timeout(180)
def test_two_resumes_of_one_sweep_at_once_run_each_unfinished_cell_once(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    for i in (2, 3):
        (work / f"hold-{i}").write_text("")  # cells 2 and 3 wait until the second resume has started
    driver = [sys.executable, "-c", DRIVER.replace("range(12)", "range(4)"), str(work), "off"]
    first = subprocess.Popen(driver, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = None
    try:
        _wait_for(lambda: set(_runs_of(work)) == {0, 1, 2, 3}, "the first resume to start every cell")
        second = subprocess.Popen(driver, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.extend(second.stderr or ()), daemon=True)
        reader.start()
        _wait_for(lambda: said, "the second resume to say that it waits")
        (first_run,) = [r for r in run_reader.list_runs() if r.alive and r.meta["pid"] == first.pid]
        assert "is running some of these cells now; waiting for it to end" in said[0], said
        assert first_run.name_on_disk in said[0] and f"pid {first.pid}" in said[0]
        for i in (2, 3):
            (work / f"hold-{i}").unlink()
        out_first, err_first = first.communicate(timeout=60)
        out_second = second.stdout.read() if second.stdout else ""  # stderr is the reader's
        second.wait(timeout=60)
        reader.join(timeout=10)
        err_second = "".join(said)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert first.returncode == 0 and second.returncode == 0, err_first + err_second
    assert out_first.split() == out_second.split() == ["0", "10", "20", "30"]
    assert _runs_of(work) == {0: 1, 1: 1, 2: 1, 3: 1}  # each cell ran once: the second resume reused them all


# ---- what the caller sees -------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_status_table_redraws_in_place_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    master, slave = pty.openpty()
    terminal = open(slave, "w", encoding="utf-8", buffering=1)  # noqa: SIM115 - closed below
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setenv("COLUMNS", "150")
    captured: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            captured.append(data)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        small = job(gpu="RTXPro6000")(jobfns.say)
        assert list(small.map(["alpha", "beta", "gamma"])) == ["alpha", "beta", "gamma"]
        big = job(gpu="RTXPro6000", stream_output=False)(jobfns.add)
        assert list(big.map(range(30))) == list(range(30))
        quiet = job(gpu="RTXPro6000", stream_output=False)(jobfns.noisy)
        assert list(quiet.map([1, 2])) == [1, 2]
    finally:
        terminal.close()
        reader.join(timeout=10)
        os.close(master)
    text = b"".join(captured).decode("utf-8", errors="replace")
    assert "\x1b[" in text  # drawn with cursor movement: redrawn in place, not appended
    assert "[say #1] beta" in text  # job output scrolls above the table, with its cell
    for header in ("cell", "arguments", "state", "card", "elapsed", "last output"):
        assert header in text
    assert "('gamma')" in text and "done" in text
    assert "say: 3 done, 0 failed, 0 running, 0 waiting of 3" in text
    assert "#0..#29" in text and "30 cells" in text  # a big sweep groups its cells
    assert "add: 30 done, 0 failed, 0 running, 0 waiting of 30" in text
    assert "a line to stderr" in text and "[noisy #" not in text  # last output shown, though not streamed


PLAIN = """
import sys
from levers9.launch import job
from tests import jobfns

fn = job(gpu="RTXPro6000", stream_output=False)(jobfns.counted)
out = list(fn.map([(sys.argv[1], i) for i in range(3)], return_exceptions=True, progress=sys.argv[2] == "on"))
print(type(out[1]).__name__)
"""


@pytest.mark.timeout(120)
def test_plain_lines_when_stderr_is_a_pipe_and_nothing_with_progress_off(tmp_path: Path) -> None:
    (tmp_path / "fail-1").write_text("")
    shown = subprocess.run(
        [sys.executable, "-c", PLAIN, str(tmp_path), "on"], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0 and shown.stdout.strip() == "CellError", shown.stderr
    lines = shown.stderr.splitlines()
    assert "\x1b" not in shown.stderr
    assert sum("running on card" in line for line in lines) == 3
    assert any(line.startswith("levers9: counted #0 (") and ": done in " in line for line in lines)
    assert any("counted #1" in line and "failed" in line and "CellError: cell 1 told to fail" in line for line in lines)
    quiet = subprocess.run(
        [sys.executable, "-c", PLAIN, str(tmp_path), "off"], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert quiet.returncode == 0 and "running on" not in quiet.stderr and "done in" not in quiet.stderr


# ---- levers9 runs ---------------------------------------------------------------------------------


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli_main(["runs", *argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.timeout(120)
def test_runs_lists_shows_and_prints_logs_of_runs_made_here(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "fail-2").write_text("")
    fn = job(gpu="RTXPro6000")(jobfns.counted)
    results = fn.map([(str(tmp_path), i) for i in range(3)], return_exceptions=True, progress=False)
    list(results)
    said = job(gpu="RTXPro6000")(jobfns.say).map(["hello there", "bye"], progress=False)
    list(said)
    capsys.readouterr()
    status, out, _ = _cli(capsys)
    assert status == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert results.run_id in rows and said.run_id in rows
    assert "2/1/3" in rows[results.run_id] and "ended" in rows[results.run_id]
    assert rows[results.run_id].split()[2] == "local"
    status, out, _ = _cli(capsys, "show", str(results.run_id))
    assert status == 0
    cell_rows = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert "done" in cell_rows["#0"] and "card" not in cell_rows["#0"]
    assert "failed" in cell_rows["#2"] and "CellError: cell 2 told to fail" in cell_rows["#2"]
    status, out, _ = _cli(capsys, "logs", str(said.run_id)[:-2], "0")  # a unique prefix works
    assert status == 0 and out == "hello there\n"
    status, _, err = _cli(capsys, "logs", str(said.run_id), "7")
    assert status == 2 and "no cell #7" in err
    status, _, err = _cli(capsys, "show", "20000101-nope")
    assert status == 2 and "no run '20000101-nope'" in err and "levers9 runs" in err


FOLLOWED = """
import sys
from levers9.launch import job
from tests import jobfns

fn = job(gpu="RTXPro6000")(jobfns.noisy_until)
print(list(fn.map([(sys.argv[1],)], progress=False)))
"""


@pytest.mark.timeout(120)
def test_runs_logs_follow_prints_until_the_cell_ends(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    sweep = subprocess.Popen([sys.executable, "-c", FOLLOWED, str(gate)], env=_env(), stdout=subprocess.PIPE)
    try:
        _wait_for(lambda: list(runs_dir().glob("*/0000-1/stdout.log")), "the cell's log")
        run_id = next(runs_dir().glob("*/0000-1")).parent.name
        follower = subprocess.Popen(
            [sys.executable, "-m", "levers9", "runs", "logs", run_id, "0", "-f"],
            env=_env(), stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert follower.stdout is not None
        assert follower.stdout.readline() == "waiting for the gate\n"
        gate.write_text("")
        rest, _ = follower.communicate(timeout=60)  # it ends by itself once the cell has ended
        assert follower.returncode == 0 and rest == "through the gate\n"
        out, _ = sweep.communicate(timeout=60)
        assert sweep.returncode == 0 and out.splitlines()[-1] == b"['done']"
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_retention_keeps_what_it_promises(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LEVERS9_KEEP_RUNS", "5")
    cells = [Cell(0, (1,), {})]
    live = run_folder.RunRecord("000-live", name="live", backend="local", func=jobfns.add, cells=cells)
    made = []
    for n in range(8):
        record = run_folder.RunRecord(f"{n + 1:03d}-done", name="done", backend="local", func=jobfns.add, cells=cells)
        record.close()
        made.append(record.path.name)
    kept = sorted(p.name for p in runs_dir().iterdir())
    assert kept == ["000-live", *made[-5:]]  # the newest 5, and the run whose caller is alive
    for bad in ("-1", "two"):  # a usage error that removes nothing
        with pytest.raises(SystemExit) as exited:
            _cli(capsys, "clean", "--keep", bad)
        assert exited.value.code == 2 and f"expected a whole number of runs (0 or more), got {bad}" in capsys.readouterr().err
    assert sorted(p.name for p in runs_dir().iterdir()) == kept
    status, out, _ = _cli(capsys, "clean", "--keep", "2")
    assert status == 0 and sorted(p.name for p in runs_dir().iterdir()) == ["000-live", *made[-2:]]
    assert run_folder.clean(older_than=3600, now=time.time() + 7200) == [runs_dir() / n for n in made[-2:]]
    live.close()
    assert run_folder.clean(older_than=0, now=time.time() + 1) == [runs_dir() / "000-live"]


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_retention_dates_a_folder_it_cannot_read_by_its_modification_time() -> None:
    record = run_folder.RunRecord("002-done", name="done", backend="local", func=jobfns.add, cells=[Cell(0, (1,), {})])
    record.close()
    broken = runs_dir() / "001-broken"
    broken.mkdir(mode=0o700)
    (broken / "run.json").write_text('{"format": 1, "sta')  # cut short by a crash
    an_hour_ago = time.time() - 3600
    os.utime(broken, (an_hour_ago, an_hour_ago))
    assert run_folder.clean(older_than=60) == [broken]
    assert [p.name for p in runs_dir().iterdir()] == ["002-done"]


@pytest.mark.timeout(30)
def test_a_run_folder_from_a_newer_levers9_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    folder = runs_dir() / "29990101-000000-future-abcdef"
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"format": run_reader.FORMAT + 1, "started": time.time(), "total": 3}))
    status, _, err = _cli(capsys, "show", folder.name)
    assert status == 2
    assert f"run format {run_reader.FORMAT + 1}" in err and "pip install -U levers9" in err
    status, out, _ = _cli(capsys)
    assert status == 0 and "newer format" in out
    # a resumed sweep passes over it instead of failing
    assert list(job(gpu="RTXPro6000")(jobfns.add).map([1, 2], resume=True, progress=False)) == [1, 2]

