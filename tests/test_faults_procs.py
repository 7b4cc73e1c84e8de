"""Pipes and children under faults (issue 23), on real processes: a long line arrives whole at a cost linear in
its length; a caller's stream that nobody reads never holds up a timeout; nothing a job or a rank started
outlives it, daemons that left its session included, and none of them keeps its card; a helper the caller
forked never keeps the caller's children alive."""

from __future__ import annotations

import functools
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from levers9 import distributed as dist
from levers9.errors import JobTimeout, RunTimeout
from levers9.launch import job
from levers9.procs import failure, start
from levers9.procs.watch import Child, Watcher
from tests import procfns, rankfns
from tests.proc_util import alive, children_of, in_group, is_torch_chatter, left_behind, wait_gone

pytestmark = pytest.mark.procs

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture
def no_strays() -> Iterator[list[int]]:
    """Pids a test learned of (daemons, helpers): SIGKILLed at the end whatever happened; and nothing the
    test started may be left running."""
    before = set(children_of(os.getpid()))
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert wait_gone(pids) == []
    assert left_behind(before) == []


def _pids(folder: Path, prefix: str) -> list[int]:
    return [int(p.read_text()) for p in sorted(folder.glob(f"{prefix}*")) if not p.name.endswith(".tmp")]


# ---- a long line ----


@pytest.mark.timeout(120)
def test_the_watcher_hands_on_a_20_mb_line_whole_in_pieces_and_keeps_only_its_start(no_strays: list[int]) -> None:
    from levers9.procs import lines

    size = 20 << 20
    got: list[tuple[str, str]] = []
    watcher = Watcher(on_text=lambda child, stream, text: got.append((stream, text)))
    method = start.choose()
    target = functools.partial(procfns.long_line, size)
    try:
        child = watcher.add(start.start(target, method=method, shipped=None if method.forks else failure.ship(target)))
        assert watcher.wait([child], 100)
        watcher.drain()
    finally:
        watcher.stop(0)
        watcher.close()
    out = "".join(text for stream, text in got if stream == "stdout")
    assert out.encode() == procfns.pattern(size) + b"\nafter the long line\n"
    assert max(len(text) for _, text in got) <= 2 * lines.PIECE_BYTES  # never held whole
    assert child.tail[-1] == "after the long line"
    assert child.tail[-2].startswith(procfns.pattern(100).decode())
    assert len(child.tail[-2]) <= 4100 and child.tail[-2].endswith("characters]")


@pytest.mark.timeout(90)
def test_a_callback_that_takes_nothing_stops_the_reading_not_the_watcher(no_strays: list[int]) -> None:
    """The child blocks on its full pipe (back-pressure, as under torchrun), the watcher keeps pumping and sees
    the child end once stopped; nothing read is lost or reordered."""
    from levers9.procs import lines

    gate = threading.Event()
    got: list[str] = []

    def on_line(child: object, stream: str, line: str) -> None:
        gate.wait()
        got.append(line)

    count = 20_000  # 20 MB: five times what the watcher holds for a callback
    watcher = Watcher(on_line)
    method = start.choose()
    target = functools.partial(procfns.numbered_lines, count)
    try:
        child = watcher.add(start.start(target, method=method, shipped=None if method.forks else failure.ship(target)))
        end = time.monotonic() + 3
        while time.monotonic() < end:
            before = time.monotonic()
            watcher.pump(0.05)
            assert time.monotonic() - before < 1.0, "pump blocked on a callback that takes nothing"
        assert not child.poll(), "the child wrote 20 MB although nobody took its output"
        assert watcher.forwarder.waiting <= lines.QUEUE_BYTES + 2 * lines.PIECE_BYTES
        gate.set()
        assert watcher.wait([child], 60)
        watcher.drain()
    finally:
        gate.set()
        watcher.stop(0)
        watcher.close()
    assert got == [procfns.numbered_line(i) for i in range(count)]


LONG_LINE = """
import os, sys
from levers9 import distributed as dist
from tests import procfns

def rank0_prints(size):
    if os.environ["RANK"] == "0":
        procfns.long_line(size)

dist.run(rank0_prints, int(sys.argv[1]), nprocs=2)
"""


@pytest.mark.timeout(120)
def test_a_20_mb_line_of_a_rank_reaches_the_callers_stdout_intact() -> None:
    size = 20 << 20
    done = subprocess.run([sys.executable, "-c", LONG_LINE, str(size)], env=_env(), capture_output=True, timeout=110)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert procfns.pattern(size) + b"\nafter the long line\n" in done.stdout
    assert len([line for line in done.stdout.split(b"\n")[:-1] if not is_torch_chatter(line)]) == 2


# ---- a caller's stdout that nobody reads ----

BLOCKED_RUN = """
import os, sys, time
import torch.distributed  # imported before the clock starts: timeout= counts from the start of the run
from levers9 import distributed as dist
from levers9.launch import job
from tests import procfns

started = time.monotonic()
try:
    if sys.argv[2] == "distributed.run":
        dist.run(procfns.print_forever, nprocs=2, timeout=5)
    else:
        job(timeout=5)(procfns.print_forever).remote()
    what = "returned"
except BaseException as exc:
    what = type(exc).__name__
procfns.write_pid(sys.argv[1] + ".pid", os.getpid())
with open(sys.argv[1], "w") as f:
    f.write(f"{what} {time.monotonic() - started:.2f}")
os._exit(0)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("how", "error"), [("distributed.run", RunTimeout), ("job", JobTimeout)])
def test_timeout_5_holds_while_nobody_reads_the_callers_stdout(
    tmp_path: Path, how: str, error: type[BaseException], no_strays: list[int]
) -> None:
    report = tmp_path / "report"
    read_end, write_end = os.pipe()  # a pipe nobody reads: `python x.py | sleep 60`
    caller = subprocess.Popen([sys.executable, "-c", BLOCKED_RUN, str(report), how], env=_env(),
                              stdout=write_end, stderr=subprocess.DEVNULL)  # fmt: skip
    os.close(write_end)
    try:
        end = time.monotonic() + 30
        while not report.exists() and time.monotonic() < end and caller.poll() is None:
            time.sleep(0.05)
        assert report.exists(), f"{how} with timeout=5 had not returned or raised after 30 s"
        what, seconds = report.read_text().split()
        assert what == error.__name__
        assert float(seconds) < 9.0, f"{error.__name__} after {seconds} s, expected about 5"
        assert caller.wait(10) == 0
    finally:
        caller.kill()
        caller.wait()
        os.close(read_end)


# ---- nothing of a job outlives it ----


@pytest.mark.timeout(120)
def test_a_cells_daemon_keeps_neither_its_card_nor_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_strays: list[int]
) -> None:
    monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:1")
    one_card = job(gpu="RTXPro6000", queue_timeout=15, stream_output=False)
    pidfile = tmp_path / "daemon"
    try:
        daemon = one_card(procfns.daemon_then_return).remote(str(pidfile))
        no_strays.append(daemon)
        assert one_card(procfns.add).remote(2, 3) == 5  # the only card is free as soon as the cell returned
    finally:
        no_strays.extend(_pids(tmp_path, "daemon"))
    assert wait_gone([daemon], 5) == []


@pytest.mark.timeout(120)
def test_a_daemon_of_a_job_that_times_out_is_stopped_with_it(tmp_path: Path, no_strays: list[int]) -> None:
    try:
        with pytest.raises(JobTimeout):
            job(timeout=4, stop_grace=1, stream_output=False)(procfns.daemon_then_hang).remote(str(tmp_path / "daemon"))
    finally:
        no_strays.extend(_pids(tmp_path, "daemon"))
    assert len(no_strays) == 1
    assert wait_gone(no_strays, 5) == []


def rank_daemon(folder: str, hang: bool) -> None:
    """Start a daemon (its pid in folder/daemon<rank>), then return or sleep until stopped."""
    procfns.start_daemon(os.path.join(folder, f"daemon{os.environ['RANK']}"))
    if hang:
        time.sleep(600)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", ["returns", "times out"])
def test_a_ranks_daemon_does_not_outlive_distributed_run(tmp_path: Path, ending: str, no_strays: list[int]) -> None:
    call = functools.partial(rank_daemon, str(tmp_path), ending == "times out")
    try:
        if ending == "returns":
            dist.run(call, nprocs=2)
        else:
            with pytest.raises(RunTimeout):
                dist.run(call, nprocs=2, timeout=6, stop_grace=1)
    finally:
        no_strays.extend(_pids(tmp_path, "daemon"))
    assert len(no_strays) == 2
    assert wait_gone(no_strays, 5) == []


# ---- a child's pid, once reaped ----

NEXT_PID = Path("/proc/sys/kernel/ns_last_pid")  # the kernel gives the next process this number plus one (root)


def _start(watcher: Watcher, target: Callable[[], object]) -> Child:
    method = start.choose()
    return watcher.add(start.start(target, method=method, shipped=None if method.forks else failure.ship(target)))


def _group_leader_with_pid(pid: int, tries: int = 5) -> subprocess.Popen[bytes] | None:
    """`sleep 120` leading a session (and process group) of its own, with pid `pid` (a free number); None
    if another process on the machine took the number first in each of `tries` tries."""
    for _ in range(tries):
        NEXT_PID.write_text(str(pid - 1))
        proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


@pytest.mark.skipif(not os.access(NEXT_PID, os.W_OK), reason="choosing the next pid (ns_last_pid) needs root")
@pytest.mark.timeout(60)
def test_stop_never_signals_the_group_that_took_the_pid_of_a_child_reaped_earlier() -> None:
    """A child that ended early is reaped and its number is free; a later process with that number, leading a
    group of its own (a Ray worker does), must survive the stop() that ends the other children."""
    watcher = Watcher(lambda child, stream, line: None)
    other: subprocess.Popen[bytes] | None = None
    try:
        slow = _start(watcher, functools.partial(time.sleep, 600))
        for _ in range(10):  # another process on a busy machine may take the freed number first: a new child then
            quick = _start(watcher, functools.partial(procfns.add, 1, 2))
            assert watcher.wait([quick], 30) and not slow.poll()
            # the number is free once nothing is left in the child's group (its watchdog, even as a zombie):
            # the kernel keeps a number while any process has it as its pid, group or session
            deadline = time.monotonic() + 30
            while in_group(quick.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            other = _group_leader_with_pid(quick.pid)
            if other is not None:
                break
        assert other is not None, "no process could be started with the pid of a reaped child in 10 rounds of 5 tries"
        watcher.stop(0)
        assert slow.poll()  # stopped
        assert other.poll() is None, f"stop() killed pid {other.pid}'s group, once a reaped child's number"
    finally:
        watcher.stop(0)
        watcher.close()
        if other is not None:
            other.kill()
            other.wait()


@pytest.mark.timeout(60)
def test_what_a_killed_child_left_in_its_group_dies_as_the_child_is_reaped(tmp_path: Path, no_strays: list[int]) -> None:
    """A child SIGKILLed from outside cannot end its own descendants: its group's leftovers (here `sleep 120`,
    and the child's watchdog) are SIGKILLed by the reaping itself, not left until stop()."""
    watcher = Watcher(lambda child, stream, line: None)
    try:
        child = _start(watcher, functools.partial(procfns.grandchild_then_hang, str(tmp_path)))
        grandchild = procfns.wait_for(str(tmp_path / "grandchild"))
        no_strays.append(grandchild)
        assert procfns.wait_for(str(tmp_path / "job")) == child.pid
        os.kill(child.pid, signal.SIGKILL)
        assert watcher.wait([child], 30) and child.signal == signal.SIGKILL
        assert wait_gone([grandchild], 10) == [], "the killed child's grandchild outlived its reaping"
    finally:
        watcher.stop(0)
        watcher.close()


@pytest.mark.timeout(60)
def test_a_child_reaped_by_the_callers_own_wait_between_polls_two_wait_calls_ends_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller's own `os.wait()` (in another thread) may reap a child after `poll()` saw it exit and before
    `poll()` reaps it: `poll()` then says it ended, with its status unknown, instead of raising from the pump.
    The other thread's wait is made to land in that window by running it in `os.killpg`, the one call between."""
    watcher = Watcher(lambda child, stream, line: None)
    try:
        child = _start(watcher, functools.partial(procfns.add, 1, 2))
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it has exited and is not reaped yet
        real_killpg = os.killpg

        def reaped_by_the_caller_first(pid: int, signum: int) -> None:
            os.waitpid(pid, 0)
            real_killpg(pid, signum)

        monkeypatch.setattr(os, "killpg", reaped_by_the_caller_first)
        assert child.poll() and child.status == (None, None)
        assert watcher.wait([child], 5)
    finally:
        monkeypatch.undo()
        watcher.stop(0)
        watcher.close()


# ---- a helper the caller forked ----

HELPER_CALLER = """
import multiprocessing, sys, time
from levers9.launch import job
from tests import procfns

folder = sys.argv[1]
assert job(stream_output=False)(procfns.add).remote(1, 2) == 3  # the caller's first job: its lifeline exists now
helper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
helper.start()
procfns.write_pid(folder + "/helper", helper.pid)
job(stream_output=False)(procfns.grandchild_then_hang).remote(folder)
"""


# A caller in a mount namespace of its own where /bin/sh cannot be executed (a container without a shell):
# every child's watchdog is then a fork of the child instead of a shell.
WITHOUT_SHELL = ["unshare", "--mount", "--", "bash", "-c", 'mount --bind /dev/null /bin/sh && exec "$@"', "-"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shell", [True, False], ids=["watchdog-is-a-shell", "no-shell-watchdog-is-a-fork"])
def test_a_helper_the_caller_forked_does_not_keep_its_jobs_alive_after_it_is_killed(
    tmp_path: Path, no_strays: list[int], shell: bool
) -> None:
    if not shell and (os.geteuid() != 0 or subprocess.run([*WITHOUT_SHELL, "true"]).returncode != 0):
        pytest.fail("this test needs root and `unshare --mount` (CI runs as root); run it as root")
    caller = subprocess.Popen([*([] if shell else WITHOUT_SHELL), sys.executable, "-c", HELPER_CALLER, str(tmp_path)],
                              env=_env())  # fmt: skip
    try:
        helper = procfns.wait_for(str(tmp_path / "helper"), 60)
        grandchild = procfns.wait_for(str(tmp_path / "grandchild"), 60)
        job_pid = procfns.wait_for(str(tmp_path / "job"), 60)
        no_strays.extend([helper, grandchild, job_pid])
        watchdogs = [p for p in children_of(job_pid) if p != grandchild]
        assert len(watchdogs) == 1
        no_strays.extend(watchdogs)
        program = Path(f"/proc/{watchdogs[0]}/cmdline").read_bytes().split(b"\0")[0]
        assert program == (b"levers9-watchdog" if shell else Path(f"/proc/{job_pid}/cmdline").read_bytes().split(b"\0")[0])
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        assert wait_gone([job_pid, grandchild, *watchdogs], 5) == []
        assert alive(helper)  # it lives on, and holds nothing of the caller's children
    finally:
        caller.kill()
        caller.wait()


@pytest.mark.timeout(60)
def test_another_local_user_cannot_name_a_key_the_ranks_read_in_the_runs_store() -> None:
    """The store is a TCP port any local user can reach; the keys of the group levers9 makes there start with
    a secret from the ranks' environment, which only their owner can read."""
    from tests import rankfns

    seen = dist.run(rankfns.what_another_user_reaches_in_the_store, nprocs=2, backend="gloo")
    assert seen["environ"] is False  # another user cannot read the ranks' environment
    assert seen["guessed"] == []  # nor name the keys holding the ranks' gloo addresses without it
    assert len(seen["secret"]) == 32 and len(seen["with_secret"]) == 2  # which the ranks did read, under the secret


IGNORES_SIGCHLD = """
import os, signal, sys, time
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
if sys.argv[1] == "run":  # levers9 run started by a process that ignores SIGCHLD (exec keeps it ignored)
    os.execv(sys.executable, [sys.executable, "-m", "levers9", "run", "--nproc-per-node", "2", sys.argv[2]])
from levers9 import distributed as dist
from tests import rankfns
print(dist.run(rankfns.describe, "ok", nprocs=2)["cfg"])
print("still ignored:", signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN)
pid = os.fork()
if pid == 0:
    os._exit(0)
time.sleep(0.2)  # the kernel reaps it at once if SIGCHLD is ignored again at the C level
try:
    os.waitpid(pid, 0)
except ChildProcessError:
    print("auto-reaped again")
"""


@pytest.mark.timeout(120)
def test_a_caller_that_ignores_sigchld_gets_its_success_and_its_setting_back(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", IGNORES_SIGCHLD, "call"], env=_env(), capture_output=True,
                          text=True, timeout=100)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:3] == ["ok", "still ignored: True", "auto-reaped again"]
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'done', flush=True)\n")
    run = subprocess.run([sys.executable, "-c", IGNORES_SIGCHLD, "run", str(script)], env=_env(),
                         capture_output=True, text=True, timeout=100)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]  # as torchrun exits: success is success
    assert "rank 0 done" in run.stdout


# ---- the limit on processes and threads (ulimit -u) ----

UNPRIVILEGED = 65534  # nobody: root ignores RLIMIT_NPROC, another user does not


def _run_as_nobody_under_a_process_limit(limit: int) -> str:
    """distributed.run(nprocs=4) in a forked child that became uid 65534 with RLIMIT_NPROC = `limit` (`ulimit -u`);
    what it printed: the exception it raised, notes and cause included, or "returned"."""
    import select
    import traceback

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        text = "returned"
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(UNPRIVILEGED)
            os.setuid(UNPRIVILEGED)
            resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
            dist.run(rankfns.describe, None, nprocs=4, backend="gloo")
        except BaseException as exc:  # noqa: BLE001 - handed to the test as text
            text = "".join(traceback.format_exception(exc))
        finally:
            os.write(write_end, text.encode())
            os._exit(0)
    os.close(write_end)
    printed, end = b"", time.monotonic() + 90
    try:
        while time.monotonic() < end:
            if not select.select([read_end], [], [], 1)[0]:
                continue
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            printed += chunk
    finally:
        os.close(read_end)
        if time.monotonic() >= end:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return printed.decode(errors="replace")


@pytest.mark.timeout(300)
def test_a_process_limit_is_named_wherever_it_is_hit(no_strays: list[int]) -> None:
    """`ulimit -u N` and four ranks: the limit is hit starting a rank, a thread of the caller's, a rank's threads
    (gloo's) or a rank's watchdog, depending on N and on timing. Wherever it is, the error names `ulimit -u N`, and a
    rank that hit it reports its own traceback (one variant ended with "exited with code 70" and nothing else)."""
    assert dist.run(rankfns.describe, None, nprocs=2, backend="gloo")["world_size"] == 2  # all imported, as root
    failed = 0
    for limit in (8, 12, 16, 20, 24):
        printed = _run_as_nobody_under_a_process_limit(limit)
        if printed == "returned":
            continue
        failed += 1
        assert f"ulimit -u {limit})" in printed and "start fewer ranks (nprocs=)" in printed, printed
        assert "exited with code 70" not in printed, printed
        if "raised on rank" in printed:  # a rank's own failure: its traceback comes with it
            assert "Traceback from rank" in printed or "Its traceback:" in printed, printed
    assert failed, "no limit was low enough to be hit"
