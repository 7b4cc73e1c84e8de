"""The local executor's own promises: leases shared across processes, the fresh-interpreter path,
log folders, queue timeouts and the progress line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from levers9.errors import InfeasibleJobError, JobCrashed, JobTimeout, RemoteError
from levers9.launch import job
from levers9.launch.local.leases import LeaseDir
from levers9.launch.settings import lease_dir, runs_dir
from tests import jobfns, proc_util
from tests.proc_util import CTRL_C_HANDLER, sigint_to_a_thread_that_is_not_main

pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def four_cards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:4")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


SWEEP = """
import json, sys
from levers9.launch import job
from tests import jobfns

fn = job(gpu="RTXPro6000", stream_output=False)(jobfns.report)
print(json.dumps(list(fn.map([(sys.argv[1] + str(i), 0.4) for i in range(4)]))))
"""


def test_two_sweeps_in_two_processes_never_share_a_card() -> None:
    drivers = [
        subprocess.Popen([sys.executable, "-c", SWEEP, tag], env=_env(), stdout=subprocess.PIPE, text=True)
        for tag in "ab"
    ]
    results = []
    for driver in drivers:
        out, _ = driver.communicate(timeout=120)
        assert driver.returncode == 0
        results += json.loads(out)
    assert len(results) == 8
    for i, a in enumerate(results):
        for b in results[i + 1 :]:
            if a["start"] < b["end"] and b["start"] < a["end"]:
                assert a["cards"] != b["cards"], f"{a['tag']} and {b['tag']} shared card {a['cards']}"


def test_a_local_map_loads_no_other_backends_code() -> None:
    """The generic job layer imports no backend package; a local map, its settings file holding another backend's
    table, loads the local backend's package and nothing of Ray's or SLURM's (their options included)."""
    script = SWEEP + "print(sorted(m for m in sys.modules if m.startswith('levers9.launch.')))\n"
    config = Path(os.environ["LEVERS9_CONFIG_DIR"])
    config.mkdir(mode=0o700, parents=True, exist_ok=True)
    (config / "workspace.toml").write_text('[slurm]\npartition = "gpu"\n')
    (config / "workspace.toml").chmod(0o600)
    out = subprocess.run([sys.executable, "-c", script, "x"], env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.splitlines()[-1]
    assert "levers9.launch.local" in loaded, loaded
    assert "levers9.launch.slurm" not in loaded and "levers9.launch.ray" not in loaded, loaded


def test_fresh_interpreter_path_keeps_the_semantics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEVERS9_START_METHOD", "spawn")
    fn = job(gpu="RTXPro6000")(jobfns.report)
    results = list(fn.map([(i, 0.1) for i in range(4)]))
    assert sorted(r["cards"] for r in results) == ["0", "1", "2", "3"]
    assert all(r["simulated"] is True for r in results)
    failing = job(gpu="RTXPro6000")(jobfns.fail)
    with pytest.raises(jobfns.CellError):
        failing.remote("custom")
    with pytest.raises(RemoteError):
        failing.remote("unrebuildable")
    with pytest.raises(JobCrashed, match="code 3"):
        failing.remote("exit")


NOTEBOOK_STYLE = """
import os
from levers9.launch import job

SCALE = 10

@job(gpu="RTXPro6000")
def scaled(x):
    return x * SCALE, os.environ["CUDA_VISIBLE_DEVICES"]

print(list(scaled.map([1, 2, 3])))
"""


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_functions_defined_in_main_run_without_a_main_guard(start: str, tmp_path: Path) -> None:
    script = tmp_path / "sweep.py"
    script.write_text(NOTEBOOK_STYLE)
    env = {**_env(), "LEVERS9_START_METHOD": start}
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "[(10, " in result.stdout and "(30, " in result.stdout


def test_each_job_keeps_its_output_and_facts_in_a_log_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    fn = job(gpu="RTXPro6000", stream_output=False)(jobfns.fail)
    with pytest.raises(JobCrashed) as info:
        fn.remote("exit")
    folder = Path(str(info.value).rsplit("Logs: ", 1)[1].strip())
    assert folder.is_relative_to(runs_dir())
    assert "about to fail: exit" in (folder / "stdout.log").read_text()
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["exit_code"] == 3 and meta["cards"] in {"0", "1", "2", "3"}


def _wait_for_files(folder: Path, pattern: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while len(list(folder.glob(pattern))) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(list(folder.glob(pattern))) == count


def test_queue_timeout_says_how_many_cards_are_free(tmp_path: Path) -> None:
    hog = job(gpu="RTXPro6000", gpu_count=1)(jobfns.hold_cards_until_released)
    held = [hog.spawn(str(tmp_path), i) for i in range(4)]
    _wait_for_files(tmp_path, "started-*", 4)  # every card is held, until the release file below
    waiter = job(gpu="RTXPro6000", queue_timeout=0.3)(jobfns.report)
    try:
        with pytest.raises(
            JobTimeout, match=r"waited 0.3 s \(queue_timeout\) for 1 RTXPro6000 card at once; 0 of"
        ):
            waiter.remote("late", 0)
    finally:
        (tmp_path / "release").touch()
    assert all(f.result(timeout=30)["cards"] for f in held)


def test_a_cancelled_running_job_gets_its_stop_grace(tmp_path: Path) -> None:
    """Leaving a sweep stops its running jobs as a timeout does: SIGTERM first, so they can save, and
    close() returns once they have. (On Ray a cancelled job is killed at once: see the README.)"""
    fn = job(gpu="RTXPro6000", stop_grace=30)(jobfns.save_on_sigterm)
    results = fn.map([(str(tmp_path), 0)])
    _wait_for_files(tmp_path, "ready-*", 1)
    pid = int((tmp_path / "ready-0").read_text())
    started = time.monotonic()
    results.close()
    assert (tmp_path / "saved-0").exists()  # its own SIGTERM handler ran before close() returned
    assert time.monotonic() - started < 20  # and close() did not wait out the 30 s grace
    assert not proc_util.alive(pid)


def test_a_spawned_job_can_be_cancelled_while_it_queues(tmp_path: Path) -> None:
    hog = job(gpu="RTXPro6000", gpu_count=1)(jobfns.report_once_started)
    held = [hog.spawn(str(tmp_path), i, 0.6) for i in range(4)]
    _wait_for_files(tmp_path, "started-*", 4)  # every card is held
    queued = hog.spawn(str(tmp_path), "queued", 0)
    assert queued.cancel()
    for f in held:
        f.result(timeout=30)
    assert queued.cancelled() and not (tmp_path / "started-queued").exists()


def test_leases_fifo_and_dead_waiters_are_skipped(tmp_path: Path) -> None:
    leases = LeaseDir(tmp_path / "pool", ["c0", "c1"])
    holder = leases.acquire(leases.take_ticket([0, 1]), 1, [[0, 1]])
    assert holder is not None and holder.slots == [0]
    big = leases.take_ticket([0, 1])  # waits for both cards
    with pytest.raises(TimeoutError):  # card 1 is free, but a later 1-card waiter must not overtake
        leases.acquire(leases.take_ticket([0, 1]), 1, [[0, 1]], timeout=0.3)
    holder.release()
    lease = leases.acquire(big, 2, [[0, 1]], timeout=5)
    assert lease is not None and sorted(lease.slots) == [0, 1]
    lease.release()
    # a waiter that died holding the oldest ticket does not block the queue
    code = (
        "import sys, time; from pathlib import Path; from levers9.launch.local.leases import LeaseDir; "
        "d = LeaseDir(Path(sys.argv[1]), ['c0', 'c1']); d.take_ticket([0, 1]); print('ok', flush=True); time.sleep(60)"
    )
    dead = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "pool")], stdout=subprocess.PIPE, text=True
    )
    assert dead.stdout is not None and dead.stdout.readline().strip() == "ok"
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    lease = leases.acquire(leases.take_ticket([0, 1]), 2, [[0, 1]], timeout=5)
    assert lease is not None
    lease.release()
    assert leases.free_slots() == [0, 1]


def test_lease_folder_is_under_the_state_dir() -> None:
    fn = job(gpu="RTXPro6000")(jobfns.add)
    assert fn.remote(1, 2) == 3
    assert lease_dir().is_relative_to(Path(os.environ["LEVERS9_STATE_DIR"]))
    assert any(lease_dir().iterdir())


def test_job_env_is_exactly_its_cards_and_the_user_env() -> None:
    fn = job(gpu="RTXPro6000", env={"EXTRA": "yes"}, cpu=2)(_env_probe)
    env = fn.remote()
    assert env["EXTRA"] == "yes" and env["OMP_NUM_THREADS"] == "2"
    assert env["CUDA_VISIBLE_DEVICES"] in {"0", "1", "2", "3"} and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert not [name for name in env if name.startswith("LEVERS9_") and name not in os.environ], "no internal variables"
    assert env["job"] == {"gpu_type": "RTXPro6000", "gpu_count": 1, "simulated": True}


def _env_probe() -> dict[str, str]:
    import levers9

    job = levers9.current_job()
    assert job is not None
    return {**os.environ, "job": {"gpu_type": job.gpu_type, "gpu_count": job.gpu_count, "simulated": job.simulated}}


def test_script_style_usage_in_a_subprocess_leaves_nothing_running(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from levers9.launch import job
            from tests import jobfns
            fn = job(gpu="RTXPro6000")(jobfns.pid_and_sleep)
            fut = fn.spawn({str(tmp_path)!r}, "bg", 60)   # never collected: the interpreter exits while it runs
            import time, pathlib
            while not pathlib.Path({str(tmp_path)!r}, "bg.child").exists():
                time.sleep(0.05)
            """
        )
    )
    subprocess.run([sys.executable, str(script)], env=_env(), timeout=60, check=True)
    pids = [int((tmp_path / n).read_text()) for n in ("bg.pid", "bg.child")]
    assert proc_util.wait_gone(pids, 10) == []


def test_real_cards_skip_other_peoples_processes_and_honour_visible_devices(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    from levers9.distributed.hardware import cards
    from tests.fakes import use_fake_pynvml
    from tests.fakes.machines import RTX_PRO_6000_SERVER, machine

    request.addfinalizer(cards.clear_cache)  # the fake machine must not outlive this test
    monkeypatch.delenv("LEVERS9_SIMULATE_GPUS")
    use_fake_pynvml(monkeypatch, machine(*[RTX_PRO_6000_SERVER] * 4, pids={2: (4242,)}))
    fn = job(gpu="RTXPro6000", stream_output=False)(jobfns.report)
    results = list(fn.map([(i, 0.2) for i in range(6)]))
    assert {r["cards"] for r in results} <= {"0", "1", "3"}  # card 2 runs someone else's process
    assert all(r["simulated"] is False for r in results)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    results = list(fn.map([(i, 0.1) for i in range(3)]))
    assert {r["cards"] for r in results} <= {"3", "1"}  # NVML indices, in PCI_BUS_ID order
    with pytest.raises(InfeasibleJobError, match="2× RTXPro6000"):
        job(gpu="H100")(jobfns.report).remote(0)


CTRL_C = """
import sys
from levers9.launch import job
from tests import jobfns

fn = job(gpu="RTXPro6000", stop_grace=1.0)(jobfns.pid_and_sleep)
try:
    list(fn.map([(sys.argv[1], i, 60) for i in range(2)]))
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


@pytest.mark.parametrize("delivered_to", ["the process", "a thread that is not main"])
def test_ctrl_c_in_the_caller_stops_the_sweep_and_raises_keyboard_interrupt(tmp_path: Path, delivered_to: str) -> None:
    driver = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_HANDLER + CTRL_C, str(tmp_path)], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in (*tmp_path.glob("*.pid"), *tmp_path.glob("*.child"))]
        if delivered_to == "the process":
            driver.send_signal(signal.SIGINT)
        else:
            sigint_to_a_thread_that_is_not_main(driver.pid)
        out, _ = driver.communicate(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode == 130 and "interrupted" in out
    assert not any(proc_util.alive(p) for p in pids)  # every job was gone before KeyboardInterrupt reached the caller
