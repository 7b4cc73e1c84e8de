"""Restarts: every rank stopped and started again after a failure a restart can cure, and only then.
Real 2-rank gloo runs; fn resumes from its own checkpoint."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from levers9 import distributed as dist
from levers9 import job
from levers9.errors import (
    ConfigError,
    JobConfigError,
    LauncherEnvError,
    RankCrashed,
    RankFailed,
    StallError,
)
from levers9.launch.settings import update_settings
from tests import restartfns
from tests.proc_util import (
    CTRL_C_HANDLER,
    board_folders_of,
    children_of,
    left_behind,
    sigint_to_a_thread_that_is_not_main,
    wait_gone,
)

pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def nothing_left() -> Iterator[None]:
    before = set(children_of(os.getpid()))
    yield
    assert left_behind(before) == []
    assert not board_folders_of(os.getpid()), "board folder left behind"


def attempts_seen(folder: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """{(restart count, rank): what that rank saw} for every attempt that reached fn."""
    seen = {}
    for path in folder.glob("attempt-*-rank-*.json"):
        _, count, _, rank = path.stem.split("-")
        seen[(int(count), int(rank))] = json.loads(path.read_text())
    return seen


def no_rank_alive(folder: Path) -> None:
    pids = [seen["pid"] for seen in attempts_seen(folder).values()]
    assert wait_gone(pids) == [], "a rank outlived the run"


@pytest.mark.timeout(120)
def test_a_killed_rank_restarts_every_rank_and_the_run_resumes_from_its_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="levers9.distributed")
    result = dist.run(restartfns.train_with_checkpoints, str(tmp_path), nprocs=2, max_restarts=2, restart_delay=0)
    # steps 0..2 ran on attempt 0 (rank 1 died after step 2's checkpoint); attempt 1 ran steps 3..5
    assert result["resumed_from"] == restartfns.DIE_AFTER_STEP + 1 and result["restart_count"] == 1
    assert result["total"] == sum(step + 0.5 for step in range(restartfns.STEPS))
    seen = attempts_seen(tmp_path)
    assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for (count, _rank), view in seen.items():
        assert view["restart_count"] == count and view["env_count"] == str(count) and view["env_max"] == "2"
        assert view["launcher"] == "levers9"
    assert seen[(0, 0)]["pid"] != seen[(1, 0)]["pid"], "rank 0 was not started again"
    lines = [r.getMessage() for r in caplog.records if "attempt" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "attempt 1 of 3 failed after" in lines[0] and "rank 1 (pid" in lines[0]
    assert "was killed by SIGKILL [crash]" in lines[0] and "(restart 1 of 2)" in lines[0]
    no_rank_alive(tmp_path)


@pytest.mark.timeout(60)
def test_a_lost_peer_is_a_comm_failure_and_restarts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1 vanishes; gloo's own error on rank 0 (the only rank that failed) is the root cause."""
    caplog.set_level(logging.WARNING, logger="levers9.distributed")
    assert dist.run(restartfns.rank_1_vanishes_on_first_attempt, str(tmp_path), nprocs=2, max_restarts=1,
                    restart_delay=0) == 1  # fmt: skip
    [line] = [r.getMessage() for r in caplog.records if "attempt" in r.getMessage()]
    assert "rank 0 (pid" in line and "raised RuntimeError" in line and "Connection" in line
    assert "[comm]; every rank was stopped; starting all 2 ranks again in 0 s (restart 1 of 1)" in line
    assert sorted(attempts_seen(tmp_path)) == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.timeout(60)
def test_a_user_key_error_is_raised_at_once_without_a_restart(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="learning_rate") as info:
        dist.run(restartfns.key_error_on_rank_1, str(tmp_path), nprocs=2, max_restarts=3, restart_delay=0)
    assert sorted(attempts_seen(tmp_path)) == [(0, 0), (0, 1)]
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "not restarted (max_restarts=3)" in notes and "'exception' failure" in notes
    assert "restart_on=('crash', 'comm', 'lost', 'stall', 'exception', 'exit')" in notes
    assert isinstance(info.value.__cause__, RankFailed)
    no_rank_alive(tmp_path)


@pytest.mark.timeout(90)
def test_a_stall_restarts_by_default(tmp_path: Path) -> None:
    assert dist.run(restartfns.stall_on_first_attempt, str(tmp_path), nprocs=2, stall_timeout=2,
                    max_restarts=1, restart_delay=0) == 1  # fmt: skip
    assert sorted(attempts_seen(tmp_path)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    no_rank_alive(tmp_path)


@pytest.mark.timeout(60)
def test_a_stall_is_not_restarted_when_restart_on_leaves_it_out(tmp_path: Path) -> None:
    with pytest.raises(StallError) as info:
        dist.run(restartfns.stall_on_first_attempt, str(tmp_path), nprocs=2, stall_timeout=2,
                 max_restarts=1, restart_delay=0, restart_on=("crash",))  # fmt: skip
    assert sorted(attempts_seen(tmp_path)) == [(0, 0), (0, 1)]
    assert "restart_on=('crash', 'stall')" in "\n".join(info.value.__notes__)
    no_rank_alive(tmp_path)


@pytest.mark.timeout(120)
def test_exhausted_restarts_list_every_root_cause_oldest_first(tmp_path: Path) -> None:
    with pytest.raises(RankCrashed) as info:
        dist.run(restartfns.crash_stall_crash, str(tmp_path), nprocs=2, stall_timeout=2, max_restarts=2, restart_delay=0)
    text = str(info.value)
    assert text.startswith("distributed.run: every attempt failed (3 attempts, max_restarts=2)")
    first, second, third = (text.index(f"  attempt {n} (ran ") for n in (1, 2, 3))
    assert first < second < third
    lines = text.splitlines()
    assert "rank 1 (pid" in lines[2] and lines[2].endswith("was killed by SIGKILL [crash]")
    assert "no rank issued or completed a collective for 2 s (stall_timeout=2)" in lines[3] and lines[3].endswith("[stall]")
    assert lines[4].endswith("was killed by SIGKILL [crash]")
    assert "The last attempt's error in full:\ndistributed.run: rank 1 (pid" in text
    assert info.value.failure is not None and info.value.failure.signal == signal.SIGKILL
    assert len(attempts_seen(tmp_path)) == 6
    no_rank_alive(tmp_path)


@pytest.mark.timeout(90)
def test_exhausted_restarts_on_exceptions_keep_the_type_and_the_last_traceback(tmp_path: Path) -> None:
    with pytest.raises(restartfns.AttemptError, match="bad batch on attempt 1") as info:
        dist.run(restartfns.raise_on_rank_1_every_attempt, str(tmp_path), nprocs=2, max_restarts=1,
                 restart_delay=0, restart_on=("exception", "exit"))  # fmt: skip
    notes = "\n".join(info.value.__notes__)
    assert "Traceback (most recent call last)" in notes and "in raise_on_rank_1_every_attempt" in notes
    assert "AttemptError: bad batch on attempt 1" in notes
    history = notes[notes.index("Root causes, oldest first:") :]
    assert history.index("bad batch on attempt 0 [exception]") < history.index("bad batch on attempt 1 [exception]")
    no_rank_alive(tmp_path)


@pytest.mark.timeout(60)
def test_a_world_of_one_with_restarts_runs_as_a_started_rank_that_can_die(tmp_path: Path) -> None:
    """In place, a SIGKILL would kill the caller; with max_restarts the one rank is a child and restarts."""
    assert dist.run(restartfns.killed_once_alone, str(tmp_path), nprocs=1, max_restarts=1, restart_delay=0) == 1
    assert sorted(attempts_seen(tmp_path)) == [(0, 0), (1, 0)]


@pytest.mark.timeout(120)
def test_job_max_restarts_reaches_distributed_run_inside_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:2")
    update_settings(multi_gpu=True)
    train = job(gpu="RTXPro6000", gpu_count=2, max_restarts=1, timeout=100, stream_output=False)(
        restartfns.job_trains_with_checkpoints
    )
    result = train.remote(str(tmp_path))
    assert result["resumed_from"] == restartfns.DIE_AFTER_STEP + 1 and result["restart_count"] == 1
    assert result["job_attempt"] == 1, "the job itself was retried instead of its ranks restarted"
    seen = attempts_seen(tmp_path)
    assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1)] and {v["env_max"] for v in seen.values()} == {"1"}
    no_rank_alive(tmp_path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delivered_to", ["the process", "a thread that is not main"])
def test_ctrl_c_during_the_restart_delay_stops_everything(tmp_path: Path, delivered_to: str) -> None:
    script = textwrap.dedent(f"""
        from levers9 import distributed as dist
        from tests import restartfns
        dist.run(restartfns.always_killed_on_rank_1, {str(tmp_path)!r}, nprocs=2, max_restarts=1, restart_delay=60)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C_HANDLER + script], env=env, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "restart 1 of 1" in line:
            break
    else:
        pytest.fail("no restart line:\n" + "".join(lines))
    started = time.monotonic()
    if delivered_to == "the process":
        proc.send_signal(signal.SIGINT)
    else:  # the forker thread: the main thread sleeping out the delay must still raise it
        sigint_to_a_thread_that_is_not_main(proc.pid)
    try:
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert time.monotonic() - started < 10
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert sorted(attempts_seen(tmp_path)) == [(0, 0), (0, 1)], "a second attempt started"
    no_rank_alive(tmp_path)


@pytest.mark.fast
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_restarts": -1}, "max_restarts=-1; expected a whole number >= 0"),
        ({"max_restarts": True}, "max_restarts=True"),
        ({"restart_on": "crash"}, "restart_on='crash' is one string; expected a tuple"),
        ({"restart_on": ("crash", "oom")}, "names 'oom'.*An out-of-memory kill is a 'crash'"),
        ({"restart_delay": -1}, "restart_delay=-1; expected a number of seconds >= 0"),
    ],
)
def test_bad_restart_arguments_are_refused_before_anything_starts(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dist.run(restartfns.always_killed_on_rank_1, "unused", nprocs=2, **kwargs)


@pytest.mark.fast
def test_restart_arguments_are_refused_under_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=r"max_restarts=2 applies only .*under torchrun.*torchrun --max-restarts"):
        dist.run(restartfns.always_killed_on_rank_1, "unused", max_restarts=2)


@pytest.mark.fast
def test_restart_count_reads_torchruns_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dist.restart_count() == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert dist.restart_count() == 3
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "three")
    with pytest.raises(LauncherEnvError, match="TORCHELASTIC_RESTART_COUNT='three'"):
        dist.restart_count()


@pytest.mark.fast
@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_job_max_restarts_is_checked_at_decoration(value: Any) -> None:
    with pytest.raises(JobConfigError, match=rf"max_restarts={re.escape(repr(value))}; expected a whole number >= 0.*retries= is the other knob"):
        job(gpu="RTXPro6000", max_restarts=value)(restartfns.job_trains_with_checkpoints)


RESTARTING_SCRIPT = """
import os, signal, sys, torch
import torch.distributed as td

td.init_process_group("gloo")                      # a script written for torchrun, unchanged
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
folder = sys.argv[1]
checkpoint = os.path.join(folder, "checkpoint")
step = int(open(checkpoint).read()) if os.path.exists(checkpoint) else 0
if attempt == 0 and td.get_rank() == 1:
    open(checkpoint + ".tmp", "w").write("5")
    os.replace(checkpoint + ".tmp", checkpoint)    # a checkpoint is written whole
    os.kill(os.getpid(), signal.SIGKILL)           # as the out-of-memory killer would
t = torch.ones(1)
td.all_reduce(t)
if td.get_rank() == 0:
    print(f"attempt {attempt} resumed at step {step}, sum {t.item():g}", flush=True)
td.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_levers9_run_max_restarts_restarts_a_torchrun_script_from_its_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(RESTARTING_SCRIPT)
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "levers9", "run", "--nproc-per-node", "2", "--max-restarts", "1",
         "--restart-delay", "0", str(script), str(tmp_path)],
        cwd=repo, capture_output=True, text=True, timeout=100, env={**os.environ, "PYTHONPATH": str(repo)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "attempt 1 resumed at step 5, sum 2" in done.stdout
    assert "restart" in done.stderr.lower()
    (tmp_path / "again").mkdir()
    no_restart = subprocess.run(
        [sys.executable, "-m", "levers9", "run", "--nproc-per-node", "2", str(script), str(tmp_path / "again")],
        cwd=repo, capture_output=True, text=True, timeout=100, env={**os.environ, "PYTHONPATH": str(repo)},
    )  # fmt: skip
    assert no_restart.returncode == 1, no_restart.stderr  # torchrun's rule: 1 for any failed rank
    assert "rank 1's exit status was 137" in no_restart.stderr  # 128 + SIGKILL, said
