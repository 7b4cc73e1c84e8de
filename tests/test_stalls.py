"""Stalled ranks are named, with where each one is, within seconds: real 2-rank gloo runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from levers9 import distributed as dist
from levers9.distributed import stalls
from levers9.distributed.stalls import board, report
from levers9.errors import StallError
from tests import rankfns
from tests.proc_util import board_folders_of, children_of, left_behind

pytestmark = pytest.mark.procs

REPO = Path(__file__).resolve().parents[1]
RANKFNS = str(REPO / "tests" / "rankfns.py")


def _line_of(marker: str) -> int:
    return next(i for i, line in enumerate(Path(RANKFNS).read_text().splitlines(), 1) if marker in line)


@pytest.fixture(autouse=True)
def nothing_left() -> Iterator[None]:
    before = set(children_of(os.getpid()))
    yield
    assert left_behind(before) == []
    assert not board_folders_of(os.getpid()), "board folder left behind"


def _stall_report(fn: Callable[[Any], None], tmp_path: Path, stall_timeout: float = 2) -> str:
    """The StallError text of a 2-rank run of fn, which must come within stall_timeout + 6 s of the moment the
    stall began (fn writes it to the file it is given: starting ranks and importing torch are not timed)."""
    mark = tmp_path / "stall-began"
    with pytest.raises(StallError) as info:
        dist.run(fn, str(mark), nprocs=2, stall_timeout=stall_timeout)
    elapsed = time.monotonic() - float(mark.read_text())
    assert elapsed < stall_timeout + 6, f"took {elapsed:.1f}s"
    return str(info.value)


NONE_YET = "not in a collective (no collective recorded yet)"


def test_a_sleeping_rank_is_named_with_its_line_and_the_waiting_rank_with_its_collective(tmp_path: Path) -> None:
    text = _stall_report(rankfns.rank1_sleeps_in_a_formed_group, tmp_path)
    assert "rank 0: waiting for gloo:all_reduce #1 to complete, for " in text
    assert "(1 collective(s) issued, 0 completed)" in text
    assert f"rank 1: {NONE_YET} at {RANKFNS}:{_line_of('STALL-LINE')} in rank1_sleeps_before_all_reduce" in text


def test_a_rank_counts_only_its_own_collectives_not_those_of_the_caller_it_was_forked_from(tmp_path: Path) -> None:
    """The caller ran collectives in a group of its own first (a notebook, an earlier run in place): a forked
    rank inherits torch's flight recorder with that group in it, and its report must not count them."""
    import torch
    import torch.distributed as td

    td.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    for _ in range(3):
        td.all_reduce(torch.ones(1))
    td.destroy_process_group()
    text = _stall_report(rankfns.rank1_sleeps_in_a_formed_group, tmp_path)
    assert "rank 0: waiting for gloo:all_reduce #1 to complete" in text
    assert "(1 collective(s) issued, 0 completed)" in text


def test_a_rank_that_skips_a_barrier_is_named() -> None:
    with pytest.raises(StallError) as info:
        dist.run(rankfns.rank1_skips_barrier, None, nprocs=2, stall_timeout=2)
    text = str(info.value)
    assert "rank 0: waiting for gloo:barrier #1 to complete" in text
    assert f"rank 1: {NONE_YET} at" in text and "rank1_skips_barrier" in text


@pytest.mark.timeout(60)
def test_a_rank_that_stopped_itself_is_named_stopped_at_once_after_its_last_collective() -> None:
    with pytest.raises(StallError) as info:
        dist.run(rankfns.rank1_stops_itself_after_a_barrier, None, nprocs=2, stall_timeout=3, stop_grace=60)
    text = str(info.value)
    assert "rank 0: waiting for gloo:barrier #2 to complete" in text
    assert (
        "rank 1: stopped (SIGSTOP, job control or a debugger: state T in /proc), so it runs no collective: it "
        "completed 1 collective(s) with the other ranks, and has not joined gloo:barrier #2, which they wait for"
    ) in text, text
    # a stopped rank is continued after its SIGTERM, so it ends at once: stop_grace=60 is not waited out (the
    # test's 60 s limit would fail first), and no sample or stack it cannot give is waited for


def test_a_slow_but_progressing_run_is_never_reported() -> None:
    assert dist.run(rankfns.slow_but_progressing, 0.6, nprocs=2, stall_timeout=1.5) == 8


def test_progress_through_collectives_issued_from_cpp_then_a_long_compute_is_never_reported() -> None:
    """DDP's all-reduce and functional collectives count as progress; afterwards nobody waits, so no stall."""
    assert dist.run(rankfns.progressing_then_computing, 0.6, nprocs=2, stall_timeout=1.5) == 6


def test_a_wait_for_a_collective_issued_from_cpp_is_named(tmp_path: Path) -> None:
    """Functional collectives never pass through torch.distributed.all_reduce: torch's flight recorder sees them."""
    text = _stall_report(rankfns.rank1_sleeps_before_a_functional_all_reduce, tmp_path)
    assert (
        "rank 0: waiting for gloo:all_reduce #2 to complete, for " in text
        and f"(2 collective(s) issued, 1 completed) at {RANKFNS}:{_line_of('FUNCOL-WAIT-LINE')}" in text
    ), text
    assert (
        f"rank 1: not in a collective (1 collective(s) issued, 1 completed) at {RANKFNS}:{_line_of('FUNCOL-SLEEP-LINE')}"
        in text
    ), text


def test_a_hang_without_stall_timeout_ends_at_timeout_with_the_same_report() -> None:
    with pytest.raises(TimeoutError) as info:
        dist.run(rankfns.rank1_sleeps_before_all_reduce, None, nprocs=2, timeout=3)
    text = str(info.value)
    assert f"rank 1: {NONE_YET} at {RANKFNS}:{_line_of('STALL-LINE')}" in text
    waiting = "rank 0: waiting for gloo:all_reduce #1 to complete" in text
    if board.forked_ranks_cannot_record("gloo"):
        # torch < 2.11: if this (pytest's) process made a group before, forked ranks record nothing, and the
        # report still says where each rank is (stall_timeout= starts fresh interpreters there instead)
        assert waiting or f"rank 0: not in a collective (no collective recorded yet) at {RANKFNS}:" in text, text
    else:
        assert waiting, text


def test_ranks_that_issued_different_numbers_of_collectives_are_a_stall() -> None:
    """NCCL returns once a collective is enqueued: the rank ahead then blocks elsewhere (here: sleeps)."""
    with pytest.raises(StallError) as info:
        dist.run(rankfns.rank0_ahead_by_an_async_collective, None, nprocs=2, stall_timeout=2)
    text = str(info.value)
    assert (
        "rank 0: waiting for gloo:all_reduce #1 to complete, for " in text
        and f"(1 collective(s) issued, 0 completed) at {RANKFNS}:{_line_of('AHEAD-LINE')}" in text
    )
    assert f"rank 1: {NONE_YET} at {RANKFNS}:{_line_of('BEHIND-LINE')}" in text


def test_with_torchs_flight_recorder_off_stall_timeout_is_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCH_FR_BUFFER_SIZE=0: levers9 wraps nothing of torch's, so it could see no stall; it says so at once."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    before = set(children_of(os.getpid()))
    with pytest.raises(ValueError, match=r"TORCH_FR_BUFFER_SIZE=0 turns off.*unset TORCH_FR_BUFFER_SIZE.*timeout="):
        dist.run(rankfns.describe, None, nprocs=2, stall_timeout=2)
    assert set(children_of(os.getpid())) <= before


@pytest.mark.parametrize("value", [0, -1, True, "5"])
def test_bad_stall_timeout_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="stall_timeout="):
        dist.run(rankfns.describe, None, nprocs=2, stall_timeout=value)  # type: ignore[arg-type]


DRIVER = """
import sys, time, torch
from levers9 import distributed as dist

def fn(cfg):
    torch.distributed.init_process_group("gloo")  # as a script written for torchrun does
    if dist.rank() == 1:
        time.sleep(120)  # LIVE-LINE
    torch.distributed.all_reduce(torch.ones(1))

if __name__ == "__main__":
    print("started", flush=True)
    dist.run(fn, None, nprocs=2, timeout=float(sys.argv[1]) if len(sys.argv) > 1 else None, init_group=False)
"""


def test_levers9_stacks_reports_a_live_run_without_stopping_it(tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), "600"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 30
        folder = None
        while time.monotonic() < end and folder is None:
            time.sleep(0.2)
            folder = stalls.find_board(proc.pid)
        assert folder is not None, "the board folder never appeared"
        time.sleep(1.0)
        done = subprocess.run(
            [sys.executable, "-m", "levers9", "stacks", str(proc.pid)], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert "rank 0: waiting for " in done.stdout
        # No stall_timeout here: only the command's own request got these counts from rank 0's recorder.
        assert "(1 collective(s) issued, 0 completed)" in done.stdout
        assert f"{script}:8 in fn" in done.stdout
        assert proc.poll() is None, "asking for stacks must not stop the run"
    finally:
        proc.kill()
        proc.wait(timeout=10)
    end = time.monotonic() + 10
    while time.monotonic() < end and stalls.find_board(proc.pid) is not None:
        time.sleep(0.1)


def test_levers9_stacks_on_a_run_without_timeout_says_how_to_get_stacks(tmp_path: Path) -> None:
    """Without timeout= or stall_timeout= levers9 installs no stack-dump handler in the ranks, and says so."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "started\n"
        done = subprocess.run(
            [sys.executable, "-m", "levers9", "stacks", str(proc.pid)], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 1
        assert "timeout= or stall_timeout=" in done.stderr and "--timeout" in done.stderr
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_levers9_stacks_for_a_pid_with_no_run_says_so() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "levers9", "stacks", "999999"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "no levers9 run" in done.stderr and "999999" in done.stderr


def test_job_stall_timeout_reaches_distributed_run_inside_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """@job(stall_timeout=...) travels in the job's typed context to the distributed.run inside it."""
    from levers9 import job

    monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:2")
    stalling = job(gpu="RTXPro6000", gpu_count=1, stall_timeout=2, timeout=60)(rankfns.job_that_stalls)
    start = time.monotonic()
    with pytest.raises(StallError, match="stall_timeout=2") as info:
        stalling.remote()
    assert "rank 1: not in a collective" in str(info.value)
    assert time.monotonic() - start < 30


def test_a_rank_stuck_before_a_ddp_step_is_named_and_the_other_waits_in_backward() -> None:
    """DDP all-reduces inside backward(), from C++: the recorder sees the waiting rank there, not only at timeout."""
    with pytest.raises(StallError) as info:
        dist.run(rankfns.rank1_stalls_before_a_ddp_step, None, nprocs=2, stall_timeout=2)
    text = str(info.value)
    assert "rank 0: waiting for gloo:all_reduce #" in text, text
    assert f"at {RANKFNS}:{_line_of('DDP-BACKWARD-LINE')} in rank1_stalls_before_a_ddp_step" in text
    assert "rank 1: not in a collective" in text and f"{RANKFNS}:{_line_of('DDP-SLEEP-LINE')}" in text, text


def _state(finished: int = 0, issued: int = -1, completed: int = -1, moved_at: float = 0.0, inside: bool = False) -> board.SlotState:
    return board.SlotState(finished, inside, moved_at, moved_at, "all_reduce" if inside else "", issued, completed, moved_at)


@pytest.mark.fast
@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ([_state(inside=True), _state()], True),  # waiting for the group to form (levers9's own wait)
        ([_state(1, 5, 4), _state(0, 4, 4)], True),  # issued and not completed (gloo's blocking call, NCCL's enqueue)
        ([_state(3, 7, 7), _state(1, 5, 5)], False),  # nothing pending: extra subgroup calls, then compute
        ([_state(1, 5, 5), _state(0)], False),  # a rank the recorder has not seen yet issued nothing
        ([_state(2), _state(2)], False),  # nothing recorded at all: everyone computes
    ],
)
def test_stall_rule(states: list[board.SlotState], expected: bool) -> None:
    assert stalls.stalled(states, stall_timeout=5, now=10) is expected
    assert stalls.stalled(states, stall_timeout=5, now=4) is False  # something moved less than 5 s ago


@pytest.mark.parametrize(
    ("quiets", "expected"),
    [
        ([stalls.Quiet(6, False), stalls.Quiet(5, True)], True),  # every node quiet, a rank on node 1 waits
        ([stalls.Quiet(6, False), stalls.Quiet(4, True)], False),  # node 1's ranks moved 4 s ago
        ([stalls.Quiet(9, False), stalls.Quiet(9, False)], False),  # every rank computes: nobody waits
        ([stalls.Quiet(5, True)], True),  # one node: the single-node rule
    ],
)
def test_a_stall_across_nodes_needs_every_node_quiet_and_one_waiting(quiets: list[stalls.Quiet], expected: bool) -> None:
    assert stalls.stall_of(quiets, stall_timeout=5) is expected


SLOW_DUMPER = """
import signal, sys, time
path = sys.argv[1]
def dump(signum, frame):
    with open(path, "a") as f:  # the newest thread first, as faulthandler writes them
        f.write('Thread 0x2 (most recent call first):\\n  File "/lib/threading.py", line 1 in run\\n\\n')
        f.flush()
        time.sleep(0.4)  # preempted between two threads' blocks
        f.write('Current thread 0x1 (most recent call first):\\n  File "/work/train.py", line 7 in step\\n'
                '  File "/lib/levers9/distributed/_rank.py", line 9 in rank_main\\n')
signal.signal(signal.SIGUSR1, dump)
print("ready", flush=True)
time.sleep(60)
"""


def test_a_dump_interrupted_between_threads_is_read_to_the_ranks_own_frames(tmp_path: Path) -> None:
    """faulthandler writes the thread running fn last; a pause before it must not cut the report short."""
    script = tmp_path / "dumper.py"
    script.write_text(SLOW_DUMPER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "stack-0.txt")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        dumps = stalls.collect_stacks({0: proc.pid}, tmp_path)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert str(report.user_frame(report.main_thread_frames(dumps[0]))) == "/work/train.py:7 in step"


def test_the_users_frame_is_found_by_where_torch_and_levers9_are_not_by_names_in_the_path() -> None:
    """A project checked out as ~/levers9 (or a clone named so) is the user's code, not the library."""
    import torch

    torch_file = str(Path(torch.__file__).parent / "distributed" / "distributed_c10d.py")
    frames = [
        report.Frame(torch_file, 3252, "all_reduce"),
        report.Frame(report.__file__, 231, "collect_stacks"),
        report.Frame("<frozen runpy>", 1, "_run_code"),
        report.Frame("/home/me/levers9/tests/train.py", 7, "step"),
    ]
    assert report.user_frame(frames) == frames[3]
