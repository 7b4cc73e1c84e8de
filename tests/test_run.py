"""distributed.run with real ranks (2 gloo ranks on the CPU): results, every failure kind, and clean-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from levers9 import distributed as dist
from levers9.errors import ConfigError, NotShippableError, RankCrashed, RankFailed, RunTimeout
from tests import rankfns
from tests.proc_util import CTRL_C_HANDLER, board_folders_of, children_of, left_behind, wait_gone

pytestmark = pytest.mark.procs

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    before = set(children_of(os.getpid()))
    yield
    assert left_behind(before) == [], "distributed.run left child processes running"
    assert not board_folders_of(os.getpid()), "board folder left behind"


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_two_ranks_return_rank0_value_with_torchrun_env(start_method: str) -> None:
    out = dist.run(rankfns.describe, {"lr": 0.1}, nprocs=2, start_method=start_method)
    assert out["rank"] == 0 and out["world_size"] == 2 and out["launcher"] == "levers9"
    assert out["mean_rank"] == pytest.approx(0.5)
    assert out["cfg"] == {"lr": 0.1}
    env = out["env"]
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
    assert out["pid"] != os.getpid()
    assert dist.world_size() == 1 and dist.launcher() == "single"  # the caller is untouched


def test_no_nprocs_and_no_card_runs_in_place() -> None:
    out = dist.run(rankfns.describe, "cfg")
    assert out["pid"] == os.getpid() and out["world_size"] == 1 and out["mean_rank"] == 0.0
    import torch.distributed as td

    assert not td.is_initialized()  # the group of one it made is gone


def test_run_leaves_a_group_it_did_not_create() -> None:
    import torch.distributed as td

    td.init_process_group("gloo", store=td.HashStore(), rank=0, world_size=1)
    try:
        assert dist.run(rankfns.describe, None)["world_size"] == 1
        assert td.is_initialized()
    finally:
        td.destroy_process_group()


def test_lambda_and_closure_work_when_forked() -> None:
    offset = 10
    assert dist.run(lambda cfg: cfg + offset + dist.rank(), 1, nprocs=2) == 11


def test_fn_without_parameters_is_called_without_cfg() -> None:
    assert dist.run(lambda: dist.world_size(), nprocs=2) == 2


def _assert_failure_report(exc: BaseException, rank: int) -> None:
    text = str(exc) + "".join(getattr(exc, "__notes__", []))
    assert f"rank {rank}" in text


def test_exception_on_a_rank_comes_back_with_type_rank_and_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(rankfns.CustomError, match="bad value 'x' on rank 1") as info:
        dist.run(rankfns.fail_on_rank_1, "x", nprocs=2)
    elapsed = time.monotonic() - start
    notes = "\n".join(info.value.__notes__)
    assert "rank 1" in notes and "fail_on_rank_1" in notes and "raise CustomError" in notes
    cause = info.value.__cause__
    assert isinstance(cause, RankFailed) and cause.failure is not None and cause.failure.rank == 1
    assert elapsed < 8, f"took {elapsed:.1f}s to report a failing rank"


@pytest.mark.timeout(60)
def test_an_exception_whose_str_raises_comes_back_with_its_type_and_traceback() -> None:
    with pytest.raises(rankfns.Unprintable) as info:
        dist.run(rankfns.unprintable_on_rank_1, None, nprocs=2)
    notes = "\n".join(info.value.__notes__)
    assert "rank 1" in notes and 'raise Unprintable("the real trouble")' in notes
    cause = info.value.__cause__
    assert isinstance(cause, RankFailed) and cause.failure is not None and cause.failure.rank == 1
    assert "Unprintable" in str(cause) and "str() of this Unprintable raised RuntimeError: no words for it" in str(cause)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_sys_exit_3_names_rank_and_code(start_method: str) -> None:
    with pytest.raises(RankCrashed) as info:
        dist.run(rankfns.exit_3_on_rank_1, None, nprocs=2, start_method=start_method)
    assert "rank 1" in str(info.value) and "sys.exit(3)" in str(info.value)
    assert info.value.failure is not None and info.value.failure.exitcode == 3
    assert "exit_3_on_rank_1" in info.value.failure.traceback


def test_os_exit_names_code_and_last_output() -> None:
    with pytest.raises(RankCrashed) as info:
        dist.run(rankfns.os_exit_on_rank_1, None, nprocs=2)
    text = str(info.value)
    assert "rank 1" in text and "exited with code 7" in text and "about to leave" in text


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSEGV])
def test_death_by_signal_names_the_signal(signum: int) -> None:
    start = time.monotonic()
    with pytest.raises(RankCrashed) as info:
        dist.run(rankfns.kill_self_on_rank_1, signum, nprocs=2)
    assert "rank 1" in str(info.value) and signal.Signals(signum).name in str(info.value)
    assert info.value.failure is not None and info.value.failure.signal == signum
    if signum == signal.SIGSEGV:  # faulthandler's dump of the Python stack is in the report
        assert "kill_self_on_rank_1" in str(info.value)
    assert time.monotonic() - start < 8


@pytest.mark.timeout(60)
def test_timeout_in_place_from_a_thread_that_is_not_the_main_one_is_a_run_timeout() -> None:
    raised: list[BaseException] = []

    def call() -> None:
        try:
            dist.run(rankfns.spin_forever, None, timeout=1)  # no card: a world of one, in this thread
        except BaseException as exc:
            raised.append(exc)

    worker = threading.Thread(target=call)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive() and len(raised) == 1
    assert isinstance(raised[0], RunTimeout), repr(raised[0])
    assert "still running after 1 s (timeout=1)" in str(raised[0])


def test_timeout_stops_every_rank_and_says_so() -> None:
    start = time.monotonic()
    with pytest.raises(RunTimeout, match=r"timeout=1\b") as info:
        dist.run(rankfns.sleep_forever, None, nprocs=2, timeout=1)
    assert isinstance(info.value, TimeoutError)
    assert "sleeping on rank 1" in str(info.value)
    assert time.monotonic() - start < 6


def test_result_bigger_than_a_pipe_comes_back() -> None:
    assert len(dist.run(rankfns.big_result, 20_000_000, nprocs=2)) == 20_000_000


def test_unpicklable_result_is_named() -> None:
    with pytest.raises(NotShippableError, match=r"result\['lock'\]"):
        dist.run(rankfns.unpicklable_result, None, nprocs=2)


def test_a_result_that_needs_a_module_only_rank_0_imported_is_named(tmp_path: Path) -> None:
    (tmp_path / "only_rank_0_has_it.py").write_text("class Thing:\n    pass\n")
    with pytest.raises(NotShippableError) as info:
        dist.run(rankfns.value_of_a_module_only_rank_0_imports, str(tmp_path), nprocs=2)
    said = str(info.value)
    assert said.startswith("distributed.run: rank 0's return value arrived but cannot be unpickled in the caller")
    assert "module 'only_rank_0_has_it' was imported there, not in this process" in said
    assert "import that module in the caller too" in said
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


@pytest.mark.timeout(60)
def test_a_few_elements_that_view_a_big_tensor_ship_alone() -> None:
    import torch

    result = dist.run(rankfns.first_ten_of_a_big_tensor, None, nprocs=2)
    head = result["head"]
    assert torch.equal(head, torch.arange(10, dtype=torch.float32))
    assert head.untyped_storage().nbytes() == 40  # not the 100 MB storage it viewed in rank 0


def test_a_deleted_current_folder_with_fresh_interpreters_is_named_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(ConfigError, match=r"the current folder '.*gone \(deleted\)' no longer exists") as info:
        dist.run(rankfns.describe, None, nprocs=2, start_method="spawn")
    assert "os.chdir() to one" in str(info.value) and "start_method='fork'" in str(info.value)


def test_unpicklable_cfg_is_named_before_fresh_ranks_start() -> None:
    import threading

    with pytest.raises(NotShippableError, match=r"cfg\['lock'\]"):
        dist.run(rankfns.describe, {"lock": threading.Lock()}, nprocs=2, start_method="spawn")


def test_grandchildren_are_stopped_with_their_rank(tmp_path: Path) -> None:
    with pytest.raises(rankfns.CustomError):
        dist.run(rankfns.grandchild_then_fail, str(tmp_path), nprocs=2)
    pids = [int((tmp_path / f"grandchild-{r}").read_text()) for r in range(2)]
    assert wait_gone(pids, 5) == []


@pytest.mark.timeout(60)
def test_a_failing_sibling_gives_the_others_stop_grace_to_save_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(rankfns.CustomError, match="rank 0 gives up"):
        dist.run(rankfns.checkpoint_on_sigterm_when_rank_0_fails, str(tmp_path), nprocs=2, stop_grace=10)
    assert (tmp_path / "checkpoint").read_text() == "step 7"


@pytest.mark.timeout(60)
def test_after_stop_grace_the_whole_tree_is_killed_even_if_it_ignores_sigterm(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(rankfns.CustomError):
        dist.run(rankfns.ignore_sigterm_with_a_grandchild_when_rank_0_fails, str(tmp_path), nprocs=2, stop_grace=1)
    assert time.monotonic() - start < 15
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert wait_gone(pids, 5) == []


@pytest.mark.fast
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"nprocs": 0}, "nprocs=0"),
        ({"stop_grace": -1}, "stop_grace=-1"),
        ({"disable_quirks": "shm-too-small"}, "one string"),
        ({"nprocs": 2.0}, "nprocs=2.0"),
        ({"nprocs": True}, "nprocs=True"),
        ({"backend": "mpi"}, "backend='mpi'"),
        ({"backend": "nccl"}, "no CUDA card"),
        ({"timeout": 0}, "timeout=0"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dist.run(rankfns.describe, None, **kwargs)


@pytest.mark.fast
@pytest.mark.parametrize("value", ["abc", "nan", "inf", "0", "-5"])
def test_a_bad_pg_timeout_variable_is_refused_by_name_before_anything_starts(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LEVERS9_PG_TIMEOUT", value)
    with pytest.raises(ConfigError, match=rf"LEVERS9_PG_TIMEOUT='{value}': expected a finite number of seconds above 0"):
        dist.run(rankfns.describe, None, nprocs=2)


@pytest.mark.fast
def test_not_a_function_is_refused() -> None:
    with pytest.raises(TypeError, match="needs a function"):
        dist.run("train.py", None)  # type: ignore[arg-type]


DRIVER = """
import os, sys, time
from levers9 import distributed as dist

def fn(cfg):
    with open(os.path.join(cfg, f"rank-{dist.rank()}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    dist.run(fn, sys.argv[1], nprocs=2, timeout=float(sys.argv[2]) if len(sys.argv) > 2 else None)
"""


def _start_driver(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], list[int]]:
    script = tmp_path / "driver.py"
    script.write_text(CTRL_C_HANDLER + DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), *extra], cwd=REPO, start_new_session=True)
    files = [tmp_path / f"rank-{r}" for r in range(2)]
    end = time.monotonic() + 30
    while time.monotonic() < end and not all(f.exists() and f.read_text() for f in files):
        time.sleep(0.05)
    return proc, [int(f.read_text()) for f in files]


def test_ctrl_c_in_the_caller_stops_every_rank(tmp_path: Path) -> None:
    proc, pids = _start_driver(tmp_path)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) != 0
    assert wait_gone(pids, 5) == []


def test_ranks_exit_when_the_caller_is_killed_outright(tmp_path: Path) -> None:
    proc, pids = _start_driver(tmp_path, "600")  # timeout= gives the run a folder (for its report)
    assert board_folders_of(proc.pid)
    proc.kill()
    proc.wait(timeout=10)
    assert wait_gone(pids, 5) == []
    dist.run(rankfns.describe, None, nprocs=2, timeout=600)  # the next such run clears what the killed caller could not
    assert not board_folders_of(proc.pid)


def _listening_sockets_of(pids: set[int]) -> list[str]:
    """Local addresses of TCP sockets in LISTEN state owned by `pids` (from /proc/net/tcp{,6})."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[3] == "0A" and parts[9] in inodes:  # 0A = LISTEN
                    found.append(parts[1])
    return found


def test_a_run_listens_on_loopback_only(tmp_path: Path) -> None:
    proc, pids = _start_driver(tmp_path)
    try:
        addresses = _listening_sockets_of({proc.pid, *pids})
        assert addresses, "expected the rendezvous store to listen somewhere"
        loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
        for address in addresses:
            host = address.split(":")[0]
            assert host in loopback, f"a socket listens on a non-loopback address: {address}"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        wait_gone(pids, 5)


def test_eight_runs_at_once_all_succeed(tmp_path: Path) -> None:
    script = tmp_path / "one.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from levers9 import distributed as dist
            def fn(cfg):
                return dist.all_reduce_mean(torch.tensor([dist.rank() + 1.0])).item()
            if __name__ == "__main__":
                print("RESULT", dist.run(fn, None, nprocs=2))
            """
        )
    )
    procs = [
        subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for _ in range(8)
    ]
    outputs = [p.communicate(timeout=240)[0].decode() for p in procs]
    for p, out in zip(procs, outputs, strict=False):
        assert p.returncode == 0, out
        assert "RESULT 1.5" in out, out
