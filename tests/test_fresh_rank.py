"""A forked rank is what torchrun or mp.spawn would have started: its own random state, an interpreter's end
(non-daemon threads joined, atexit handlers, files flushed, sys.excepthook), torchrun's thread count, and a
failure report that names the rank that failed first by itself, every rank that failed, and no levers9 frames.
Each is checked side by side with torchrun on the same script where torchrun can run it."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path
from typing import Any

import numpy.random
import pytest
import torch

from levers9 import distributed as dist
from levers9.errors import FailureKind, RankCrashed, RankFailed, RunTimeout
from levers9.launch import job
from tests import proc_util, scriptfns

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(scriptfns.SCRIPTS / "fresh_process.py")
PEER_KILLED = str(scriptfns.SCRIPTS / "peer_killed.py")
pytestmark = pytest.mark.launchers
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
    "levers9 run": [sys.executable, "-m", "levers9", "run", "--nproc-per-node", "2"],
    "levers9 run, fresh interpreters": [sys.executable, "-m", "levers9", "run", "--nproc-per-node", "2",
                                        "--start-method", "spawn"],
}  # fmt: skip


def launch(launcher: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        return subprocess.run([*LAUNCHERS[launcher], *args], env={**env, "TMPDIR": tmp}, capture_output=True,
                              text=True, timeout=120)  # fmt: skip


def drawn(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]


def assert_ended_as_an_interpreter(out: Path) -> None:
    for rank in range(2):
        assert (out / f"open.{rank}").read_text() == "seventeen bytes!\n", "a file left open was not flushed"
        assert (out / f"atexit.{rank}").read_text() == "ran", "the rank's atexit handler did not run"
        assert (out / f"thread.{rank}").read_text() == "saved", "a non-daemon thread was cut off"


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_a_rank_starts_with_its_own_random_state_and_ends_as_an_interpreter(launcher: str, tmp_path: Path) -> None:
    done = launch(launcher, SCRIPT, str(tmp_path))
    assert done.returncode == 0, done.stderr
    zero, one = drawn(tmp_path)
    for source in ("torch", "numpy", "python", "loader_worker_seed"):
        assert zero[source] != one[source], f"{source}: both ranks drew the same unseeded numbers under {launcher}"
    assert zero["threads"] == one["threads"] == 1 and zero["omp"] == "1"
    assert_ended_as_an_interpreter(tmp_path)


def test_seeded_ranks_draw_exactly_what_they_draw_under_torchrun(tmp_path: Path) -> None:
    seen = {}
    for launcher in ("torchrun", "levers9 run"):
        out = tmp_path / launcher.replace(" ", "_")
        out.mkdir()
        done = launch(launcher, SCRIPT, str(out), "7")
        assert done.returncode == 0, done.stderr
        seen[launcher] = [{k: d[k] for k in ("torch", "numpy", "python", "loader_worker_seed")} for d in drawn(out)]
    assert seen["torchrun"][0] == seen["torchrun"][1], "the script's seed does not make its ranks draw alike"
    assert seen["levers9 run"] == seen["torchrun"]


@pytest.mark.parametrize("launcher", ["torchrun", "levers9 run"])
def test_an_uncaught_exception_reaches_the_scripts_own_excepthook(launcher: str, tmp_path: Path) -> None:
    done = launch(launcher, SCRIPT, str(tmp_path), "-", "1")
    assert done.returncode == 1
    assert (tmp_path / "excepthook.1").read_text() == "RuntimeError: rank 1 gives up"
    assert not (tmp_path / "excepthook.0").exists()


def test_distributed_run_ranks_are_fresh_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.manual_seed(0)  # the caller's seed is the caller's: a rank starts unseeded, as under mp.spawn
    numpy.random.seed(0)  # numpy's global generator too, once the caller has imported it
    dist.run(scriptfns.fresh_record, (str(tmp_path), None, None), nprocs=2, backend="gloo")
    zero, one = drawn(tmp_path)
    for source in ("torch", "numpy", "python", "loader_worker_seed"):
        assert zero[source] != one[source], source
    assert zero["threads"] == one["threads"] == 1, "ranks kept the caller's thread pool"
    assert_ended_as_an_interpreter(tmp_path)


def test_a_thread_count_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert dist.run(scriptfns.thread_count, nprocs=2, backend="gloo") == (2, "2")


def test_job_cells_draw_their_own_random_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:2")
    cells = list(job(gpu="RTXPro6000", stream_output=False)(scriptfns.torch_draw).map([(), ()]))
    assert cells[0] != cells[1]


def test_a_run_stopped_while_a_rank_waits_for_its_threads_names_them() -> None:
    with pytest.raises(RunTimeout, match="waiting for its non-daemon thread\\(s\\) 'slow-uploader'"):
        dist.run(scriptfns.leaves_a_thread_running, 60.0, nprocs=2, backend="gloo", timeout=5)


def test_a_killed_rank_is_the_root_cause_and_its_kind_restarts() -> None:
    with pytest.raises(RankCrashed) as caught:
        dist.run(scriptfns.peer_killed, "kill", nprocs=2, backend="gloo", max_restarts=1, restart_delay=0)
    failure = caught.value.failure
    assert failure is not None and failure.rank == 1 and failure.signal == 9 and failure.kind is FailureKind.CRASH
    text = str(caught.value)
    assert text.count("rank 1 (pid") >= 2 and "attempt 2" in text, "the SIGKILL was not restarted, or not blamed"
    assert "rank 0 also failed" in text


@pytest.mark.parametrize("launcher", ["torchrun", "levers9 run"])
def test_a_killed_rank_is_named_by_the_launcher(launcher: str) -> None:
    done = launch(launcher, PEER_KILLED, "kill")
    assert done.returncode != 0
    if launcher == "levers9 run":
        headline = next(line for line in done.stderr.splitlines() if line.startswith("levers9 run: "))
        assert headline.startswith("levers9 run: rank 1 ") and "SIGKILL" in headline, done.stderr


@pytest.mark.parametrize("launcher", ["torchrun", "levers9 run"])
def test_sigint_to_one_rank_is_that_ranks_failure(launcher: str) -> None:
    done = launch(launcher, PEER_KILLED, "int")
    assert done.returncode == 1, done.stderr
    if launcher == "levers9 run":
        assert "rank 1" in done.stderr and "KeyboardInterrupt" in done.stderr and "interrupted" not in done.stderr


def test_sigint_to_one_rank_is_an_exception_for_the_caller() -> None:
    with pytest.raises(Exception) as caught:  # not KeyboardInterrupt: the caller was not interrupted
        dist.run(scriptfns.peer_killed, "int", nprocs=2, backend="gloo")
    assert isinstance(caught.value, RankFailed) and caught.value.failure is not None
    assert caught.value.failure.rank == 1 and caught.value.failure.exc_type == "KeyboardInterrupt"


def test_every_rank_that_failed_is_reported_with_its_own_frames_only() -> None:
    with pytest.raises(ValueError) as caught:
        dist.run(scriptfns.two_ranks_raise, nprocs=3, backend="gloo")
    report = str(caught.value.__cause__)
    assert "could not read its shard" in report
    assert "rank 1 could not read its shard" in report and "rank 2 could not read its shard" in report
    assert "also failed" in report
    assert "levers9/procs/child.py" not in report and "rank_process.py" not in report


RAISING_CALLER = """
from levers9 import distributed as dist
from tests import scriptfns
dist.run(scriptfns.two_ranks_raise, nprocs=3, backend="gloo")
"""


@pytest.mark.timeout(120)
def test_a_failed_run_prints_each_ranks_traceback_once_from_the_callers_line() -> None:
    """On the console: each rank that failed by itself once (torch's excepthook in the rank, the report and the note
    each printed it: up to four copies), and one frame of levers9's between the caller's line and the report, the one
    that raised it (there were 13)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", RAISING_CALLER], env=env, capture_output=True, text=True, timeout=100)
    printed = done.stdout + done.stderr
    assert done.returncode == 1 and "ValueError" in printed, printed
    failed = [rank for rank in (0, 1, 2) if f"rank {rank} (pid " in printed]  # each rank that failed by itself, named
    assert 1 in failed or 2 in failed, printed
    assert printed.count("Traceback (most recent call last):") == len(failed) + 1, printed  # and the caller's own
    assert "[rank1]:" not in printed and "[rank2]:" not in printed, printed  # torch's excepthook in the rank
    assert len(proc_util.levers9_frames(printed)) == 1, printed


def on_a_terminal(argv: list[str], gate: Path, seconds: float = 120) -> tuple[bytes, int]:
    """Run `argv` on a pseudo-terminal 100 columns wide, answering tests/scripts/terminal.py as a person would:
    each progress redraw is let through only once it is on the screen, and the name is typed at its prompt."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env["TMPDIR"] = str(gate.parent)  # torchrun's agent leaves its torchelastic_* folder there
    pid, fd = pty.fork()
    if pid == 0:  # the child: exec at once
        os.execve(argv[0], argv, env)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    screen, typed, end = b"", False, time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:  # EIO: the launcher and its ranks closed the terminal
                    break
                if not chunk:
                    break
                screen += chunk
            for i in range(3):
                if f"step {i}/3".encode() in screen:
                    (gate.parent / f"{gate.name}.{i}").touch()
            if b"name? " in screen and not typed:
                os.write(fd, b"world\n")
                typed = True
    finally:
        if time.monotonic() >= end:
            os.kill(pid, 9)
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return screen, os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("launcher", ["torchrun", "levers9 run"])
def test_ranks_see_the_callers_terminal_and_rank_0_reads_its_stdin(launcher: str, tmp_path: Path) -> None:
    screen, code = on_a_terminal([*LAUNCHERS[launcher], str(scriptfns.SCRIPTS / "terminal.py"), str(tmp_path / "gate")],
                                 tmp_path / "gate")  # fmt: skip
    assert code == 0, screen.decode(errors="replace")
    for rank in (0, 1):
        assert f"rank {rank} isatty=True columns=100".encode() in screen
    assert b"\rstep 2/3" in screen, "a redraw did not reach the screen before its line ended"
    assert b"raw \xff\xfe bytes" in screen, "bytes that are not UTF-8 were changed on their way"
    assert b"hello 'world'" in screen, "rank 0 could not read what was typed"


REDRAWS_CALLER = """
import sys
from levers9 import distributed as dist
from tests import scriptfns
dist.run(scriptfns.redraws_a_progress_line, sys.argv[1], nprocs=2, backend="gloo")
"""


def redraws_through_a_pipe(argv: list[str], gate: Path, seconds: float = 120) -> tuple[dict[tuple[int, int], float], bytes, int]:
    """Run `argv` with its stdout a pipe, as a log shipper or `| tee` reads it, answering scriptfns.redraws_a_progress_line:
    each redraw is let through once it was read here. How late each (rank, step) redraw was read, in seconds after
    its rank wrote it; the bytes read; the exit status."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env["TMPDIR"] = str(gate.parent)  # torchrun's agent leaves its torchelastic_* folder there
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env, start_new_session=True)
    assert proc.stdout is not None
    late: dict[tuple[int, int], float] = {}
    out, end = b"", time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if not select.select([proc.stdout], [], [], 0.1)[0]:
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            now = time.monotonic()
            if not chunk:
                break
            out += chunk
            for found in re.finditer(rb"rank (\d) step (\d)/3 at ([0-9.]+) ", out):
                key = (int(found[1]), int(found[2]))
                if key not in late:
                    late[key] = now - float(found[3])
                    (gate.parent / f"{gate.name}.{key[0]}.{key[1]}").touch()
    finally:
        if time.monotonic() >= end:
            os.killpg(proc.pid, 9)
        proc.stdout.close()
        code = proc.wait()
    return late, out, code


@pytest.mark.timeout(200)
@pytest.mark.parametrize("launcher", ["torchrun", "levers9 run", "distributed.run"])
def test_a_progress_redraw_reaches_a_pipe_as_it_is_written(launcher: str, tmp_path: Path) -> None:
    """A tqdm-style "\\r" redraw on any rank reaches the caller's stdout when it is a pipe (a file, a notebook: any
    stream that is not a terminal) as it is written, as under torchrun, where ranks write to the caller's stdout
    themselves: it was held until its line ended. Each rank waits for its redraw to be read before it goes on, up
    to 20 s; one held back would be read 20 s late or more. Rank 1's redraws carry its prefix after each "\\r"."""
    gate = tmp_path / "gate"
    if launcher == "distributed.run":
        argv = [sys.executable, "-c", REDRAWS_CALLER, str(gate)]
    else:
        argv = [*LAUNCHERS[launcher], str(scriptfns.SCRIPTS / "redraws.py"), str(gate)]
    late, out, code = redraws_through_a_pipe(argv, gate)
    assert code == 0, out.decode(errors="replace")
    assert sorted(late) == [(rank, step) for rank in (0, 1) for step in range(3)], out.decode(errors="replace")
    assert max(late.values()) < 10, f"redraws read this many seconds after they were written: {late}"
    if launcher != "torchrun":
        assert b"\r[rank 1] rank 1 step 2/3" in out and b"\rrank 0 step 2/3" in out
    assert out.count(b"done\n") == 2, out.decode(errors="replace")


FLAGS_CALLER = """
import json, sys
sys.path.insert(0, sys.argv[1])  # under -I neither PYTHONPATH nor the script's folder is on the path
from levers9 import distributed as dist
from tests import rankfns
method = None if sys.argv[2] == "env" else sys.argv[2]
ranks = dist.run(rankfns.interpreter_flags_on_every_rank, nprocs=2, backend="gloo", start_method=method)
print(json.dumps({"caller": rankfns.interpreter_flags(), "ranks": ranks}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("flags", "method"), [(["-O"], "spawn"), (["-I"], "env"), (["-O", "-I"], "spawn")])
def test_the_callers_interpreter_flags_reach_fresh_interpreter_ranks(flags: list[str], method: str) -> None:
    """`python -O` strips asserts and `python -I` isolates from the environment in every rank started as a fresh
    interpreter, as mp.spawn passes them on (start_method="spawn", or LEVERS9_START_METHOD=spawn); they ran
    without them."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # what -I ignores
    if method == "env":
        env["LEVERS9_START_METHOD"] = "spawn"
    done = subprocess.run([sys.executable, *flags, "-c", FLAGS_CALLER, str(REPO), method], env=env, capture_output=True,
                          text=True, timeout=100)  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    caller = seen["caller"]
    assert caller["asserts_run"] is ("-O" not in flags) and caller["isolated"] == ("-I" in flags)
    assert caller["dont_write_bytecode"] == ("-I" not in flags)
    assert seen["ranks"] == [caller, caller]


CLOSED_STDOUT = """
import sys
from levers9 import distributed as dist
from tests import scriptfns
assert sys.stdout is None
print(dist.run(scriptfns.prints_and_returns, 7, nprocs=2, backend="gloo"), file=sys.stderr)
"""


def test_a_closed_stdout_costs_only_the_output() -> None:
    """`python sweep.py >&-`: Python's sys.stdout is None; print() writes nothing, and so does levers9."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(f"{sys.executable} -c '{CLOSED_STDOUT}' >&-", shell=True, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-1] == "7"


def test_a_stdout_pipe_whose_reader_left_is_named_once_as_such(tmp_path: Path) -> None:
    """`levers9 run train.py | head -1`: the reader left, and the warning says so, once, with one "levers9: " (it
    said "levers9: levers9: ...", and expected "a stream with write()" of a pipe that has one)."""
    (tmp_path / "train.py").write_text("import os\nfor i in range(3):\n    print('line', i, 'of rank', os.environ['RANK'], flush=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    reader, writer = os.pipe()
    os.close(reader)  # the reader left before the first line
    try:
        done = subprocess.run([*LAUNCHERS["levers9 run"], str(tmp_path / "train.py")], stdout=writer, stderr=subprocess.PIPE,
                              env=env, text=True, timeout=120)  # fmt: skip
    finally:
        os.close(writer)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "refused children's output" in line]
    assert len(said) == 1, done.stderr
    assert said[0].startswith("levers9: sys.stdout refused children's output (BrokenPipeError") and "levers9: levers9" not in said[0]
    assert "a pipe whose reader has gone" in said[0] and "`> out.log`" in said[0] and "stream with write()" not in said[0]


class WriteOnly:
    """The StreamToLogger recipe: a sys.stdout with `write` and nothing else."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        self.lines.append(text)
        return len(text)


def test_a_stdout_without_flush_keeps_every_result(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = WriteOnly()
    monkeypatch.setattr(sys, "stdout", stream)
    assert dist.run(scriptfns.prints_and_returns, 3, nprocs=2, backend="gloo") == 3
    monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:2")
    cells = job(gpu="RTXPro6000", stream_output=True)(scriptfns.prints_and_returns)
    assert list(cells.map([1, 2])) == [1, 2]
    assert any("working on 3" in text for text in stream.lines) and any("working on 2" in text for text in stream.lines)


def test_spawn_passes_output_through_as_mp_spawn_does(capfd: pytest.CaptureFixture[str]) -> None:
    dist.spawn(scriptfns.spawned_prints, nprocs=2)
    out = capfd.readouterr().out
    assert "process 1 says hi\n" in out and "[rank 1]" not in out
    dist.spawn(scriptfns.spawned_prints, nprocs=2, prefix_output=True)
    assert "[rank 1] process 1 says hi\n" in capfd.readouterr().out


def test_a_job_process_ends_as_an_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:1")
    assert job(gpu="RTXPro6000")(scriptfns.job_ends_as_an_interpreter).remote(str(tmp_path)) == "returned"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "open").read_text() == "seventeen bytes!\n"
    assert (tmp_path / "thread").read_text() == "saved"


def test_an_executor_left_open_is_told_to_stop_as_at_an_interpreters_exit() -> None:
    assert dist.run(scriptfns.leaves_an_executor_open, nprocs=2, backend="gloo", timeout=60) == "returned"
