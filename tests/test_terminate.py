"""SIGTERM or SIGHUP to the process that waits for ranks or jobs (a scheduler preempting it, `docker stop`,
a closed terminal): every rank or job gets SIGTERM and its grace period, so its own handler can save a
checkpoint, and the caller then exits with 128 + the signal (`levers9 run`: 1, as torchrun does). Before,
the caller died at once and its children died by SIGKILL with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from levers9.procs.watch import exit_on_terminate
from tests import jobfns
from tests.proc_util import CTRL_C_HANDLER, wait_gone

pytestmark = pytest.mark.launchers

REPO = Path(__file__).resolve().parents[1]

RUN_CALLER = """
import sys
from levers9 import distributed as dist
from tests import jobfns

def train(folder):
    jobfns.save_on_sigterm(folder, dist.rank())

if __name__ == "__main__":
    # 30 s of grace, as SWEEP_CALLER's: the 5 s default was once too short for a rank to run its handler
    # with two three-worker suites on 2 cores
    dist.run(train, sys.argv[1], nprocs=2, stop_grace=30)
"""

SCRIPT = """
import os, sys
from tests import jobfns

jobfns.save_on_sigterm(sys.argv[1], os.environ["RANK"])
"""

SWEEP_CALLER = """
import sys
from levers9.launch import job
from tests import jobfns

fn = job(gpu="RTXPro6000", stop_grace=30)(jobfns.save_on_sigterm)
if sys.argv[2] == "map":
    list(fn.map([(sys.argv[1], i) for i in range(2)]))
else:
    fn.remote(sys.argv[1], 0)
"""


def _start(tmp_path: Path, how: str) -> tuple[subprocess.Popen[bytes], int]:
    """The caller, started the way `how` names; and how many ranks or jobs it runs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    folder = str(tmp_path)
    if how == "distributed.run":
        argv, count = [sys.executable, "-c", RUN_CALLER, folder], 2
    elif how == "levers9 run":
        (tmp_path / "train.py").write_text(SCRIPT)
        argv, count = [sys.executable, "-m", "levers9", "run", "--nproc-per-node", "2", str(tmp_path / "train.py"), folder], 2
    else:
        env["LEVERS9_SIMULATE_GPUS"] = "RTXPro6000:2"
        argv, count = [sys.executable, "-c", SWEEP_CALLER, folder, how.split(".")[1]], (2 if how == "fn.map" else 1)
    return subprocess.Popen(argv, cwd=REPO, env=env, start_new_session=True, stderr=subprocess.PIPE), count


@pytest.mark.parametrize("how", ["distributed.run", "levers9 run", "fn.map", "fn.remote"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_terminated_caller_lets_every_child_save_its_checkpoint_then_exits_128_plus_the_signal(
    tmp_path: Path, how: str, signum: int
) -> None:
    caller, count = _start(tmp_path, how)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready-*"))) < count and caller.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in tmp_path.glob("ready-*")]
        assert len(pids) == count, f"the children did not start (caller exit status {caller.poll()})"
        caller.send_signal(signum)
        _, err = caller.communicate(timeout=60)
        expected = 1 if how == "levers9 run" else 128 + signum  # levers9 run exits as torchrun's agent does
        assert caller.returncode == expected, err.decode()
    finally:
        if caller.poll() is None:
            os.killpg(caller.pid, signal.SIGKILL)
            caller.wait()
    saved = sorted(p.name for p in tmp_path.glob("saved-*"))
    assert saved == [f"saved-{i}" for i in range(count)]  # each one's own SIGTERM handler ran
    assert wait_gone(pids, 5) == []
    if how == "levers9 run":
        assert f"levers9 run: got {signal.Signals(signum).name}; every rank was stopped." in err.decode()


@pytest.mark.timeout(120)
def test_levers9_run_and_torchrun_exit_alike_when_they_get_sigterm(tmp_path: Path) -> None:
    """Measured side by side: the launcher itself gets SIGTERM while its ranks wait; both exit with one status."""
    statuses = {}
    for name, launcher in (("torchrun", ["-m", "torch.distributed.run", "--standalone"]), ("levers9", ["-m", "levers9", "run"])):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "train.py").write_text(SCRIPT)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "TMPDIR": str(folder)}  # fmt: skip
        proc = subprocess.Popen([sys.executable, *launcher, "--nproc-per-node", "2", str(folder / "train.py"), str(folder)],
                                cwd=REPO, env=env, start_new_session=True, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while len(list(folder.glob("ready-*"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(list(folder.glob("ready-*"))) == 2, f"{name}'s ranks did not start"
            proc.send_signal(signal.SIGTERM)
            statuses[name] = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert statuses["levers9"] == statuses["torchrun"], statuses


COMPUTE_CALLER = """
import sys
from levers9 import distributed as dist
from tests import jobfns

def train(folder):
    jobfns.computes_and_saves_slowly_on_sigterm(folder, dist.rank())

if __name__ == "__main__":
    dist.run(train, sys.argv[1], nprocs=2, stop_grace=60)
"""

COMPUTE_SCRIPT = """
import os, sys
from tests import jobfns

jobfns.computes_and_saves_slowly_on_sigterm(sys.argv[1], os.environ["RANK"])
"""


def _start_computing(folder: Path, how: str) -> subprocess.Popen[bytes]:
    """A caller whose two ranks compute and save slowly on SIGTERM (jobfns.computes_and_saves_slowly_on_sigterm),
    started as `how` names; it takes Ctrl-C even where this process ignores SIGINT."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "TMPDIR": str(folder)}  # fmt: skip
    if how == "distributed.run":
        argv = [sys.executable, "-c", CTRL_C_HANDLER + COMPUTE_CALLER, str(folder)]
    else:
        (folder / "train.py").write_text(COMPUTE_SCRIPT)
        launcher = ["-m", "torch.distributed.run", "--standalone"] if how == "torchrun" else ["-m", "levers9", "run"]
        argv = [sys.executable, *launcher, "--nproc-per-node", "2", str(folder / "train.py"), str(folder)]
    return subprocess.Popen(argv, cwd=REPO, env=env, start_new_session=True, stderr=subprocess.PIPE)


def _wait_for(folder: Path, pattern: str, caller: subprocess.Popen[bytes]) -> list[Path]:
    """The two files `pattern` names, once both exist (up to 60 s, or until the caller ended)."""
    deadline = time.monotonic() + 60
    while len(list(folder.glob(pattern))) < 2 and caller.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    found = sorted(folder.glob(pattern))
    assert len(found) == 2, f"only {[p.name for p in found]} appeared (caller exit status {caller.poll()})"
    return found


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("how", "signum"),
    # torchrun passes a SIGHUP on to its workers as it is, not as SIGTERM: a SIGTERM handler sees only its SIGTERM
    [(how, signum) for how in ("distributed.run", "levers9 run") for signum in (signal.SIGTERM, signal.SIGHUP)]
    + [("torchrun", signal.SIGTERM)],
    ids=lambda value: value.name if isinstance(value, signal.Signals) else value,
)
def test_a_second_sigterm_or_sighup_keeps_the_grace_of_ranks_that_compute(tmp_path: Path, how: str, signum: int) -> None:
    """A scheduler that repeats its SIGTERM, or a closed terminal (the kernel and the shell each send SIGHUP): the
    second signal comes while the ranks save their checkpoints in their grace period, and must not cut it short (it
    SIGKILLed every rank at once). Each rank saves only after the second signal was sent, computing meanwhile;
    torchrun side by side."""
    caller = _start_computing(tmp_path, how)
    try:
        pids = [int(p.read_text()) for p in _wait_for(tmp_path, "ready-*", caller)]
        caller.send_signal(signum)
        _wait_for(tmp_path, "stopping-*", caller)  # every rank got its SIGTERM and is saving
        caller.send_signal(signum)
        (tmp_path / "go").touch()
        _, err = caller.communicate(timeout=90)
    finally:
        if caller.poll() is None:
            os.killpg(caller.pid, signal.SIGKILL)
            caller.wait()
    assert sorted(p.name for p in tmp_path.glob("saved-*")) == ["saved-0", "saved-1"], err.decode()
    assert caller.returncode == (128 + signum if how == "distributed.run" else 1), err.decode()
    assert wait_gone(pids, 5) == []


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_stops_every_rank_at_once(tmp_path: Path) -> None:
    """Ctrl-C twice still means "now": the first gives the ranks their grace (60 s here), the second SIGKILLs them
    while they save."""
    caller = _start_computing(tmp_path, "distributed.run")
    try:
        pids = [int(p.read_text()) for p in _wait_for(tmp_path, "ready-*", caller)]
        caller.send_signal(signal.SIGINT)
        _wait_for(tmp_path, "stopping-*", caller)
        caller.send_signal(signal.SIGINT)
        _, err = caller.communicate(timeout=30)  # well within the 60 s of grace the first Ctrl-C gave
    finally:
        if caller.poll() is None:
            os.killpg(caller.pid, signal.SIGKILL)
            caller.wait()
    assert "KeyboardInterrupt" in err.decode(), err.decode()
    assert list(tmp_path.glob("saved-*")) == []
    assert wait_gone(pids, 5) == []


def test_a_handler_the_caller_installed_is_kept_and_the_default_comes_back_afterwards() -> None:
    def own(signum: int, frame: object) -> None:
        pass

    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with exit_on_terminate():
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        with exit_on_terminate():  # nested waits keep the outer one's handler
            pass
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        with pytest.raises(SystemExit) as exited:
            signal.raise_signal(signal.SIGTERM)
        assert exited.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    previous = signal.signal(signal.SIGHUP, own)
    try:
        with exit_on_terminate():
            assert signal.getsignal(signal.SIGHUP) is own
        assert signal.getsignal(signal.SIGHUP) is own
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_remote_catches_sigterm_and_sighup_before_its_job_starts() -> None:
    """Once the job runs, a SIGTERM or SIGHUP to the caller must give it its grace: the handler is in place from
    before the job starts (it was installed only when the caller began to wait, and a signal sent as soon as the
    job ran, on a loaded machine, once killed the caller outright), and gone again afterwards."""
    from levers9.launch import job

    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    caught = job(stream_output=False)(jobfns.signals_the_parent_catches).remote()
    assert signal.SIGTERM in caught and signal.SIGHUP in caught
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL


def test_outside_the_main_thread_nothing_is_installed() -> None:
    seen: list[object] = []

    def wait_in_a_thread() -> None:
        with exit_on_terminate():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=wait_in_a_thread)
    thread.start()
    thread.join(10)
    assert seen == [signal.SIG_DFL]
