"""The backend contract: what every backend (local, Ray, SLURM) must do, against its real engine, with real
job processes.

Jobs are short sleepers that report the CUDA_VISIBLE_DEVICES they saw, on which node, and when they ran; the
`backend` fixture names the backend and sets up its cards, and `cards` says what they are (CARDS):
4 simulated RTXPro6000 on one machine for "local"; for "ray" the session's one local Ray with 4 logical
GPUs declared as levers9_RTXPro6000 (tests/ray_cluster.py), reached through RAY_ADDRESS as a user's
cluster would be; for "slurm" the real two-node SLURM of compat_tests/slurm_cluster.sh (tests/slurm_cluster.py):
2 nodes x 2 GRES cards of type h100, each node numbering its own cards 0-1.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from levers9.errors import (
    InfeasibleJobError,
    JobCrashed,
    JobTimeout,
    NotShippableError,
    RemoteError,
    WorkspacePolicyError,
)
from levers9.launch import Retries, job
from levers9.launch.settings import update_settings
from tests import jobfns, nodefns, proc_util, ray_cluster, slurm_cluster
from tests.timeouts import timed_out_once_started

pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = [
    "local",
    pytest.param("ray", marks=pytest.mark.ray),
    pytest.param("slurm", marks=[pytest.mark.slurm, pytest.mark.xdist_group("slurm")]),  # one worker: the one cluster
]


@dataclasses.dataclass(frozen=True)
class Cards:
    """What a backend's cards are: what the tests ask for and expect back."""

    type: str  # levers9's name of their type (@job(gpu=...))
    other_type: str  # a type it has none of
    per_node: int  # cards on one node, numbered 0 to per_node - 1 there (CUDA_VISIBLE_DEVICES)
    total: int  # cards in all

    @property
    def ids(self) -> set[str]:
        """The CUDA_VISIBLE_DEVICES a one-card job may see."""
        return {str(i) for i in range(self.per_node)}


CARDS = {
    "local": Cards("RTXPro6000", "H100", per_node=4, total=4),
    "ray": Cards("RTXPro6000", "H100", per_node=4, total=4),
    "slurm": Cards("H100", "RTXPro6000", per_node=2, total=4),  # compat_tests/slurm_cluster.sh
}


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A backend name, with its CARDS to run on."""
    if request.param == "local":
        monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:4")
    elif request.param == "ray":
        monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address(request.config))
    else:  # skipped with the reason printed when the cluster cannot be had
        monkeypatch.setenv("SLURM_CONF", slurm_cluster.slurm_conf(request.config))
        monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the jobs' tasks import levers9 and tests/ from this checkout
    yield request.param


@pytest.fixture
def cards(backend: str) -> Cards:
    return CARDS[backend]


@pytest.fixture
def multi_gpu() -> None:
    update_settings(multi_gpu=True)


def _overlapping_jobs_share_no_card(results: list[dict[str, Any]]) -> None:
    """No two jobs that ran at one time held one card. A card is (node, index): SLURM's nodes each number their
    own cards from 0, so jobs on two nodes may both see CUDA_VISIBLE_DEVICES=0."""
    for i, a in enumerate(results):
        for b in results[i + 1 :]:
            if a["start"] < b["end"] and b["start"] < a["end"] and a["node"] == b["node"]:
                shared = set(a["cards"].split(",")) & set(b["cards"].split(","))
                assert not shared, f"{a['tag']} and {b['tag']} overlapped in time on card(s) {shared} of {a['node']}"


def test_map_runs_each_cell_on_its_own_card_in_input_order(backend: str, cards: Cards, tmp_path: Path) -> None:
    # eight cells on four cards, four at a time: no cell goes on before four have started
    assert cards.total == 4, "report_once_four_run waits for four cells running at once: one per card"
    fn = job(gpu=cards.type, gpu_count=1, backend=backend)(jobfns.report_once_four_run)
    cells = [(str(tmp_path), i, 0.6 - 0.1 * (i % 4)) for i in range(8)]  # later cells finish first
    results = list(fn.map(cells))
    assert [r["tag"] for r in results] == list(range(8))
    assert all(r["cards"] in cards.ids for r in results)
    assert all(r["order"] == "PCI_BUS_ID" and r["gpu_count"] == "1" for r in results)
    _overlapping_jobs_share_no_card(results)


def test_cells_expand_tuple_dict_and_single_argument(backend: str) -> None:
    fn = job(backend=backend)(jobfns.add)
    assert list(fn.map([(1, 2), {"a": 3, "b": 4}, 5])) == [3, 7, 5]
    assert list(fn.map([1, 2], kwargs={"b": 10})) == [11, 12]


def test_remote_and_spawn(backend: str, cards: Cards) -> None:
    fn = job(gpu=cards.type, backend=backend)(jobfns.report)
    assert fn.remote("r", 0.05)["cards"] in cards.ids
    future = fn.spawn("s", 0.05)
    assert future.result(timeout=30)["tag"] == "s"
    assert fn("here", 0)["pid"] == os.getpid()  # a plain call runs in place


def test_cpu_job_gets_no_card(backend: str) -> None:
    fn = job(backend=backend)(jobfns.report)
    result = fn.remote("cpu", 0)
    assert result["cards"] == "" and result["gpu_count"] == "0" and result["pid"] != os.getpid()


def test_gang_allocation_takes_all_cards_at_once(backend: str, cards: Cards, multi_gpu: None) -> None:
    pair = job(gpu=cards.type, gpu_count=2, backend=backend)(jobfns.report)
    single = job(gpu=cards.type, gpu_count=1, backend=backend)(jobfns.report)
    futures = [pair.spawn(f"pair{i}", 0.3) for i in range(3)] + [
        single.spawn(f"one{i}", 0.3) for i in range(3)
    ]
    results = [f.result(timeout=60) for f in futures]
    for r in results[:3]:
        assert len(set(r["cards"].split(","))) == 2 and r["gpu_count"] == "2"
    _overlapping_jobs_share_no_card(results)


def test_first_come_first_served_does_not_starve_a_big_job(backend: str, cards: Cards, multi_gpu: None) -> None:
    # The time limits change nothing on this machine or Ray; on SLURM they are what keeps the big job's place.
    # SLURM's backfill scheduler may start a later job on cards a waiting bigger one needs, when the later job's
    # time limit ends before the bigger one's reserved start (the running jobs' time limits): it does not delay
    # it. With no time limits (the partition's INFINITE) that start is unknown and the late 1-card jobs were seen
    # to take the cards the big one waited for. With time limits (2 min for the early ones and the big one, 11
    # for the late ones: levers9 asks SLURM for timeout= rounded up to minutes, plus one) every late one would
    # delay the big one, so SLURM must start them after it, as first come, first served does.
    single = job(gpu=cards.type, gpu_count=1, timeout=60, backend=backend)(jobfns.report)
    later = job(gpu=cards.type, gpu_count=1, timeout=600, backend=backend)(jobfns.report)
    whole = job(gpu=cards.type, gpu_count=cards.total, timeout=60, backend=backend)(jobfns.report)
    early = [single.spawn(f"early{i}", 0.6) for i in range(3)]
    time.sleep(0.2)  # the early ones hold three cards
    big = whole.spawn("big", 0.2)
    time.sleep(0.1)
    late = [later.spawn(f"late{i}", 0.2) for i in range(4)]
    big_result = big.result(timeout=60)
    late_results = [f.result(timeout=60) for f in late]
    assert all(r["start"] >= big_result["end"] - 0.05 for r in late_results), (
        "a later 1-card job jumped the queue"
    )
    _overlapping_jobs_share_no_card([f.result() for f in early] + [big_result, *late_results])


def test_infeasible_job_fails_at_once(backend: str, cards: Cards, multi_gpu: None) -> None:
    too_many = job(gpu=cards.type, gpu_count=2 * cards.total, backend=backend)(jobfns.report)
    started = time.monotonic()
    with pytest.raises(InfeasibleJobError, match=cards.type):
        list(too_many.map([1, 2]))
    wrong_type = job(gpu=cards.other_type, backend=backend)(jobfns.report)
    with pytest.raises(InfeasibleJobError, match=cards.type):
        wrong_type.remote(1)
    assert time.monotonic() - started < 5


def test_switch_flipped_between_calls_changes_only_the_second(backend: str, cards: Cards) -> None:
    pair = job(gpu=cards.type, gpu_count=2, backend=backend)(jobfns.report)
    with pytest.raises(WorkspacePolicyError, match="levers9 workspace multi-gpu on"):
        pair.remote("refused", 0)
    update_settings(multi_gpu=True)
    running = pair.spawn("first", 0.5)
    update_settings(multi_gpu=False)
    with pytest.raises(WorkspacePolicyError, match="multi_gpu"):
        pair.spawn("second", 0)
    assert running.result(timeout=60)["gpu_count"] == "2"  # the accepted call was not affected


def test_cap_refuses_more_cards_than_allowed(backend: str, cards: Cards, multi_gpu: None) -> None:
    update_settings(max_gpu_count=2)
    four = job(gpu=cards.type, gpu_count=4, backend=backend)(jobfns.report)
    with pytest.raises(WorkspacePolicyError, match="GPU count must be 2 or less"):
        four.remote("x", 0)


def test_timeout_kills_the_job_and_frees_its_cards(backend: str, cards: Cards, tmp_path: Path, multi_gpu: None) -> None:
    # the job holds a whole node's cards, as one job process (on SLURM, a job across nodes would call the function
    # in every rank, after their process group is up: the timeout would come before any rank wrote its pid)
    sleep = 120.0

    def run(timeout: int) -> None:
        started = time.monotonic()
        try:
            job(gpu=cards.type, gpu_count=cards.per_node, timeout=timeout, stop_grace=1.0, backend=backend)(
                jobfns.pid_and_sleep
            ).remote(str(tmp_path), "t", sleep)
        finally:  # it was the timeout that ended the call, not the function's return
            assert time.monotonic() - started < sleep

    timed_out_once_started(run, started=lambda: (tmp_path / "t.pid").exists())  # written after t.child
    pids = [int((tmp_path / name).read_text()) for name in ("t.pid", "t.child")]
    assert proc_util.wait_gone(pids, 30) == [], "the job or its child outlived the timeout"
    # every card is free again (a wait for what was freed: a hang fails); a job's context counts the cards of its
    # node (on SLURM, 2 nodes x 2 for this one)
    fn = job(gpu=cards.type, gpu_count=cards.total, queue_timeout=60, backend=backend)(jobfns.report)
    assert fn.remote("after", 0)["gpu_count"] == str(cards.per_node)


def test_a_timeout_reaches_the_ranks_of_the_jobs_distributed_run_with_their_grace(
    backend: str, cards: Cards, tmp_path: Path, multi_gpu: None
) -> None:
    """The job is stopped with SIGTERM on timeout; the distributed.run inside it passes it on, so each rank whose
    handler was in place saves. A rank still starting when the timeout came (a loaded machine, a slow SLURM start)
    had no handler yet and dies of the SIGTERM, as it would under any launcher: it is not counted."""
    fn = job(gpu=cards.type, gpu_count=2, timeout=12, backend=backend)(jobfns.ranks_that_save_on_sigterm)
    with pytest.raises(JobTimeout):
        fn.remote(str(tmp_path))
    ready = {p.name.removeprefix("ready-") for p in tmp_path.glob("ready-*")}  # the ranks whose handler was in place
    saved = {p.name.removeprefix("saved-") for p in tmp_path.glob("saved-*")}
    assert ready, "no rank had its SIGTERM handler in place after 12 s: nothing was tested"
    assert ready <= saved, f"ranks {sorted(ready - saved)} had their handler in place and did not save (saved: {sorted(saved)})"
    assert proc_util.wait_gone([int(p.read_text()) for p in tmp_path.glob("ready-*")], 5) == []


@pytest.mark.parametrize(
    ("kind", "expected"), [("exit", "code 3"), ("kill", "SIGKILL"), ("sys.exit", "code 4")]
)
def test_crash_is_reported_with_exit_status_and_last_output(backend: str, cards: Cards, kind: str, expected: str) -> None:
    fn = job(gpu=cards.type, backend=backend)(jobfns.fail)
    with pytest.raises(JobCrashed, match=expected) as info:
        fn.remote(kind)
    assert "about to fail" in str(info.value)


def test_crash_is_retried(backend: str, cards: Cards, tmp_path: Path) -> None:
    marker = tmp_path / "attempts"
    fn = job(gpu=cards.type, retries=Retries(1, initial_delay=0), backend=backend)(jobfns.crash_once)
    assert fn.remote(str(marker)) == "ok after 2 attempts"
    marker.unlink()
    no_retry = job(gpu=cards.type, backend=backend)(jobfns.crash_once)
    with pytest.raises(JobCrashed, match="attempt 1 of 1"):
        no_retry.remote(str(marker))


def test_a_timed_out_attempt_is_retried(backend: str, cards: Cards, tmp_path: Path) -> None:
    marker = tmp_path / "attempts"
    # timeout= counts from the job's start, which on SLURM is the task's interpreter starting (as SLURM's own time
    # limit counts): 2 s was not always enough for the second attempt to reach the function on a loaded machine.
    # The first attempt sleeps 60 s, so any timeout well below that tests the same thing.
    fn = job(gpu=cards.type, timeout=10, stop_grace=0.5, retries=Retries(1, initial_delay=0), backend=backend)(jobfns.slow_once)
    assert fn.remote(str(marker)) == "ok after 2 attempts"


def test_an_exception_is_retried_only_when_asked(backend: str, cards: Cards, tmp_path: Path) -> None:
    marker = tmp_path / "attempts"
    by_default = job(gpu=cards.type, retries=Retries(1, initial_delay=0), backend=backend)(jobfns.raise_once)
    with pytest.raises(ValueError, match="first attempt fails"):
        by_default.remote(str(marker))
    assert marker.read_text() == "1"
    marker.unlink()
    asked = job(gpu=cards.type, retries=Retries(1, initial_delay=0, on=("exception", "comm", "stall")), backend=backend)(jobfns.raise_once)
    assert asked.remote(str(marker)) == "ok after 2 attempts"


def test_exceptions_keep_their_type_and_traceback(backend: str, cards: Cards) -> None:
    fn = job(gpu=cards.type, backend=backend)(jobfns.fail)
    with pytest.raises(ValueError, match="boom") as value_error:
        fn.remote("value")
    notes = "\n".join(getattr(value_error.value, "__notes__", []))
    assert "jobfns.py" in notes and "raise ValueError" in notes
    with pytest.raises(jobfns.CellError):
        fn.remote("custom")
    with pytest.raises(RemoteError, match="Unrebuildable") as remote:
        fn.remote("unrebuildable")
    assert "a=1 b=2" in str(remote.value)


def test_an_unpicklable_result_is_a_clear_error(backend: str) -> None:
    fn = job(backend=backend)(jobfns.lock_result)
    with pytest.raises(NotShippableError, match="cannot be pickled"):
        fn.remote()


def test_map_raises_the_first_failure_with_its_cell(backend: str, cards: Cards) -> None:
    fn = job(gpu=cards.type, backend=backend)(jobfns.fail)
    with pytest.raises(ValueError) as info:
        list(fn.map([("value", "first"), ("custom", "second")]))
    assert any("cell #0 ('value', 'first')" in note for note in info.value.__notes__)
    results = list(fn.map([("value", "x"), ("custom", "y")], return_exceptions=True))
    assert isinstance(results[0], ValueError) and isinstance(results[1], jobfns.CellError)


def test_leaving_the_loop_cancels_the_rest(backend: str, cards: Cards, tmp_path: Path) -> None:
    fn = job(gpu=cards.type, stop_grace=1.0, backend=backend)(jobfns.quick_or_slow)
    for result in fn.map([(str(tmp_path), i) for i in range(8)]):
        assert result == 0
        break
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) < 7, "cells queued behind the four cards should never have started"
    assert proc_util.wait_gone(pids, 5) == []
    # They were stopped, not waited for: none woke from its 600 s sleep (waiting would outlast the test's timeout).
    assert list(tmp_path.glob("*.done")) == []


def test_dropping_the_results_cancels_the_rest(backend: str, cards: Cards, tmp_path: Path) -> None:
    fn = job(gpu=cards.type, stop_grace=1.0, backend=backend)(jobfns.quick_or_slow)
    results = fn.map([(str(tmp_path), i) for i in range(1, 4)])
    # a wait for the three cells to start, not a race: on Ray, with two three-worker suites on 2 cores,
    # none had started 20 s in; 120 s is for a backend that never starts them
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("*.pid"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    del results
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 3, f"{len(pids)} of the 3 cells had started after 120 s"
    assert proc_util.wait_gone(pids, 5) == []


def test_more_cells_than_cards_start_in_input_order(backend: str, cards: Cards, tmp_path: Path) -> None:
    # twelve cells that hold their card for 600 s: once four have started no other can, and the four must be
    # the first four (on Ray more tasks than cards are queued in Ray, in the order levers9 submits them)
    fn = job(gpu=cards.type, stop_grace=1.0, backend=backend)(jobfns.quick_or_slow)
    results = fn.map([(str(tmp_path), i) for i in range(1, 13)])
    try:
        deadline = time.monotonic() + 120  # for a backend that never starts four
        while len(list(tmp_path.glob("*.pid"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        started = sorted(int(p.stem) for p in tmp_path.glob("*.pid"))
    finally:
        results.close()
    first = list(range(1, cards.total + 1))
    assert started == first, f"cells {started} took the {cards.total} cards; expected the first {cards.total}, {first}"
    assert proc_util.wait_gone([int(p.read_text()) for p in tmp_path.glob("*.pid")], 5) == []


DRIVER = """
import sys
from tests import jobfns, ray_cluster
from levers9.launch import job

fn = job(gpu=sys.argv[3], backend=sys.argv[2])(jobfns.pid_and_sleep)
print("driver started", flush=True)
list(fn.map([(sys.argv[1], i, 60) for i in range(2)]))
"""


def test_the_callers_death_ends_its_jobs(backend: str, cards: Cards, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path), backend, cards.type], env=env)
    try:
        deadline = time.monotonic() + 60
        # each job writes <tag>.child, then <tag>.pid: wait for both of both jobs
        while len(list(tmp_path.glob("*.child"))) + len(list(tmp_path.glob("*.pid"))) < 4 and time.monotonic() < deadline:
            assert driver.poll() is None, "the driver exited early"
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in (*tmp_path.glob("*.pid"), *tmp_path.glob("*.child"))]
        assert len(pids) == 4
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        assert proc_util.wait_gone(pids, 10) == [], "jobs outlived the caller"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    # their cards are free again: the map waits for them (Ray frees a dead driver's cards a while after
    # its processes end, 10 s and more on a loaded machine), and the test's time limit fails a leak
    fn = job(gpu=cards.type, queue_timeout=None, backend=backend)(jobfns.report)
    assert len(list(fn.map([(i, 0) for i in range(cards.total)]))) == cards.total


def test_output_is_streamed_with_the_cell_as_prefix(backend: str, cards: Cards, capfd: pytest.CaptureFixture[str]) -> None:
    fn = job(gpu=cards.type, backend=backend)(jobfns.noisy)
    assert list(fn.map([2, 1])) == [2, 1]
    out, err = capfd.readouterr()
    assert "[noisy #0] line 1 to stdout" in out and "[noisy #1] line 0 to stdout" in out
    assert "[noisy #1] a line to stderr" in err


def test_of_two_ranks_failing_apart_every_backend_names_the_first_in_time(
    backend: str, cards: Cards, multi_gpu: None, tmp_path: Path
) -> None:
    """Rank 3 raises, rank 1 raises 50 ms later (on SLURM they are on different nodes): every backend names rank 3
    with its own exception type, by the core's root-cause rule (first in time), not the lowest rank that failed."""
    fn = job(gpu=cards.type, gpu_count=4, timeout=120, stop_grace=2.0, backend=backend)(nodefns.train)
    cfg = {"fn": "fail_apart", "first": 3, "second": 1, "gap": 0.05, "mark": str(tmp_path / "first-failed")}
    with pytest.raises(nodefns.NodeError, match="rank 3 fails first"):
        fn.remote(cfg)


def test_multi_card_job_runs_distributed_ranks(backend: str, cards: Cards, multi_gpu: None) -> None:
    fn = job(gpu=cards.type, gpu_count=2, timeout=120, backend=backend)(jobfns.run_distributed)
    result = fn.remote(3)
    assert result == {"world_size": 2, "rank": 0, "cfg": {"steps": 3}}
