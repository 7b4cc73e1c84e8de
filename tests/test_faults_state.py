"""levers9's own state survives faults (issue 23, the state half): a full disk (a real small tmpfs as
the state folder), hand-edited or malformed files, many callers at once with a retention of 1, another
user's files and folders (chowned to uid 12345, or made by a child that setuid to it), a HOME that is
not writable, and bad seconds given to @job. None of them may cost a healthy cell or a result."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from levers9.cli import main as cli_main
from levers9.errors import JobConfigError, PrivateDirError, SettingsError
from levers9.launch import job, run_folder, run_reader
from levers9.launch.settings import load_settings, runs_dir, settings_path
from tests import ray_cluster
from tests.proc_util import board_folders_of, remove_shm_boards_if_empty

pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parent.parent
OTHER_UID = 12345


# ---- job bodies (module level: a job process started fresh imports them) -------------------------


def chatty(lines: int) -> int:
    """Print `lines` lines of 1000 bytes to stdout, and return how many."""
    text = "x" * 999
    for _ in range(lines):
        print(text)
    sys.stdout.flush()
    return lines


def big(n: int) -> bytes:
    """A 400 KB result."""
    return bytes([n]) * 400_000


def plus_one(n: int) -> int:
    return n + 1


# ---- helpers ----------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """mount(size) -> a fresh tmpfs of that size (mode 0700); every one is unmounted afterwards."""
    mounts: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk{len(mounts)}"
        where.mkdir(mode=0o700)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)], check=True)
        mounts.append(where)
        return where

    yield mount
    for where in reversed(mounts):
        subprocess.run(["umount", str(where)], check=True)


def _state_on(monkeypatch: pytest.MonkeyPatch, disk: Path) -> Path:
    state = disk / "state"
    monkeypatch.setenv("LEVERS9_STATE_DIR", str(state))
    return state


def _fill(folder: Path) -> None:
    """Fill the disk `folder` is on, with a file in it."""
    with open(folder / "filler", "wb", buffering=0) as handle:  # unbuffered: nothing left to fail again at close
        try:
            while True:
                handle.write(b"\0" * 65536)
        except OSError:
            pass


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("levers9")]


def _leftovers(folder: Path) -> list[Path]:
    """Partial files and half-made run folders under `folder`."""
    return [p for p in folder.rglob("*") if p.name.endswith(".partial") or p.name.startswith(".new-")]


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli_main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


# ---- a full disk ------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_job_logs_that_do_not_fit_are_dropped_with_one_warning_and_every_cell_succeeds(
    small_disk: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    state = _state_on(monkeypatch, small_disk("2m"))
    fn = job(stream_output=False)(chatty)
    with caplog.at_level(logging.WARNING, logger="levers9"):
        results = fn.map([700] * 8, progress=False)  # 8 cells of 700 KB of output on a 2 MB disk
        assert list(results) == [700] * 8
    said = _warnings(caplog)
    assert len(said) == 1, said
    assert str(state / "runs") in said[0] and "is full" in said[0] and "MB of job output" in said[0]
    assert "LEVERS9_STATE_DIR" in said[0]
    assert _leftovers(state) == []
    (run,) = run_reader.list_runs()
    assert run.status == "ended" and run.counts() == (8, 0, 8)
    # cells whose state changes did not fit are 'not recorded', never guessed 'cancelled'
    assert {c.state for c in run.cells()} <= {"done", "not recorded"}


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_on_ray_too_job_logs_that_do_not_fit_are_dropped_with_one_warning(
    small_disk: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address(request.config))
    state = _state_on(monkeypatch, small_disk("2m"))
    fn = job(stream_output=False, backend="ray")(chatty)
    with caplog.at_level(logging.WARNING, logger="levers9"):
        assert list(fn.map([700] * 4, progress=False)) == [700] * 4
    said = _warnings(caplog)
    assert len(said) == 1 and "B of job output" in said[0] and str(state / "runs") in said[0], said
    assert _leftovers(state) == []
    (run,) = run_reader.list_runs()
    assert run.status == "ended" and run.counts() == (4, 0, 4)


@pytest.mark.timeout(180)
def test_results_that_cannot_be_stored_return_anyway_and_the_warning_says_resume_will_not_find_them(
    small_disk: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    state = _state_on(monkeypatch, small_disk("2m"))
    fn = job(stream_output=False)(big)
    with caplog.at_level(logging.WARNING, logger="levers9"):
        assert list(fn.map(range(8), progress=False)) == [bytes([n]) * 400_000 for n in range(8)]
    said = _warnings(caplog)
    assert len(said) == 1 and "resume will not find them" in said[0], said
    assert _leftovers(state) == []  # no .partial file of a result that did not fit
    (run,) = run_reader.list_runs()
    assert run.status == "ended"  # not 'interrupted': its end was written in the room run.json keeps
    kept = len(list((run.path / run_reader.RESULTS).iterdir()))
    named = re.findall(r"#(\d+)", said[0])
    assert 0 < kept < 8 and kept + len(named) == 8  # the warning names exactly the cells not kept
    caplog.clear()
    # resume finds what was kept and reruns the rest; the disk is still full, so it says so again
    with caplog.at_level(logging.WARNING, logger="levers9"):
        assert list(fn.map(range(8), progress=False, resume=True)) == [bytes([n]) * 400_000 for n in range(8)]
    assert _leftovers(state) == [] and len(_warnings(caplog)) <= 1


@pytest.mark.timeout(120)
def test_remote_on_a_full_disk_says_what_was_lost_before_it_returns(
    small_disk: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    state = _state_on(monkeypatch, small_disk("2m"))
    fn = job(stream_output=False)(big)
    with caplog.at_level(logging.WARNING, logger="levers9"):
        for n in range(6):  # 400 KB results on a 2 MB disk: the last ones cannot be kept
            assert fn.remote(n) == bytes([n]) * 400_000
            said = _warnings(caplog)  # read at once: the warning of a call is said before that call returns
            if said:
                break
    assert len(said) == 1 and "resume will not find them" in said[0], said
    assert all(run.status == "ended" for run in run_reader.list_runs())  # each record was closed before return
    assert _leftovers(state) == []


def _fill_inodes(folder: Path) -> None:
    """Use up the inodes of the disk `folder` is on (where a new folder or file fails, as on a full ext4)."""
    try:
        for n in range(100_000):
            (folder / f"f{n}").touch()
    except OSError:
        pass


@pytest.mark.timeout(120)
@pytest.mark.parametrize("full", ["blocks", "inodes"])
def test_a_sweep_on_a_full_state_folder_says_so_in_one_line_and_runs(
    full: str, small_disk: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    disk = small_disk("1m" if full == "blocks" else "1m,nr_inodes=64")
    state = _state_on(monkeypatch, disk)
    if full == "blocks":
        (state / "runs").mkdir(parents=True, mode=0o700)
        _fill(disk)
    else:
        _fill_inodes(disk)  # not even the state folder can be made
    fn = job(stream_output=False)(chatty)
    with caplog.at_level(logging.WARNING, logger="levers9"):
        assert list(fn.map([3, 4], progress=False)) == [3, 4]
        assert fn.remote(5) == 5
    said = _warnings(caplog)
    assert len(said) == 2, said  # one line per sweep, none per cell
    for line in said:
        assert f"the state folder {state / 'runs'} is full" in line and "LEVERS9_STATE_DIR" in line
        assert "\n" not in line
    assert not (state / "runs").exists() or list((state / "runs").iterdir()) == []  # nothing half-made left


def _read_only(folder: Path) -> None:
    """Remount the tmpfs at `folder` read-only (root ignores mode bits, not a read-only mount)."""
    subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)


@pytest.mark.timeout(180)
def test_a_full_state_folder_never_costs_a_card_job_its_lease(
    small_disk: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:  # fmt: skip
    state = _state_on(monkeypatch, small_disk("2m"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))  # where leases go when the state folder is full
    monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:4")
    fn = job(gpu="RTXPro6000", stream_output=False)(chatty)
    assert list(fn.map([1, 2], progress=False)) == [1, 2]  # the lease folder is made while there is room
    _fill(state)  # as 8 cells of 700 KB of output would, sooner or later: now, so that every ticket meets it
    with caplog.at_level(logging.WARNING, logger="levers9"):
        assert list(fn.map([700] * 8, progress=False)) == [700] * 8
    said = _warnings(caplog)
    moved = [line for line in said if "card lease folder" in line]
    assert len(moved) == 1 and str(state / "leases") in moved[0] and "is full" in moved[0], said
    assert str(tmp_path / "runtime" / "levers9" / "leases") in moved[0]
    assert _leftovers(state) == []


@pytest.mark.timeout(180)
def test_a_read_only_state_folder_used_before_never_costs_a_cell_nor_a_timed_run(
    small_disk: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:  # fmt: skip
    from levers9 import distributed as dist
    from tests import rankfns

    disk = small_disk("4m")
    _state_on(monkeypatch, disk)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:2")
    fn = job(gpu="RTXPro6000", stream_output=False)(plus_one)
    assert list(fn.map(range(2), progress=False)) == [1, 2]  # leases, runs and boards made while it was writable
    assert dist.run(rankfns.describe, "ok", nprocs=2, timeout=60)["cfg"] == "ok"
    _read_only(disk)
    try:  # the timed run's board goes to /dev/shm next
        with caplog.at_level(logging.WARNING, logger="levers9"):
            assert list(fn.map(range(4), progress=False)) == [1, 2, 3, 4]
            assert dist.run(rankfns.describe, "still", nprocs=2, timeout=60)["cfg"] == "still"
        assert not board_folders_of(os.getpid()), "the timed run left its board folder"
    finally:
        remove_shm_boards_if_empty()
    said = _warnings(caplog)
    assert any("card lease folder" in line and "cannot be written (Read-only file system)" in line for line in said), said


@pytest.mark.timeout(60)
def test_cards_stay_exclusive_between_a_caller_whose_lease_folder_is_read_only_and_one_that_used_it_before(
    small_disk: Callable[[str], Path], tmp_path: Path
) -> None:
    from levers9.launch.local.leases import LeaseDir

    disk = small_disk("1m")
    fallback = tmp_path / "fallback"
    before = LeaseDir(disk / "pool", ["c0"], fallback)
    held = before.acquire(before.take_ticket([0]), 1, [[0]], timeout=5)
    assert held is not None
    view = tmp_path / "read-only-view"  # the same folder, seen through a read-only bind mount
    view.mkdir()
    subprocess.run(["mount", "--bind", str(disk), str(view)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
        after = LeaseDir(view / "pool", ["c0"], fallback)  # cannot queue there: queues in the fallback folder
        with pytest.raises(TimeoutError):
            after.acquire(after.take_ticket([0]), 1, [[0]], timeout=0.3)  # card 0 is held in the first folder
        assert after.home == fallback and after.free_slots() == []
        held.release()
        lease = after.acquire(after.take_ticket([0]), 1, [[0]], timeout=5)
        assert lease is not None and lease.slots == [0]
        assert before.free_slots() == []  # and the first folder's callers see it held from the fallback folder
        lease.release()
    finally:
        held.release()  # no descriptor left open on either mount, so both unmount
        subprocess.run(["umount", str(view)], check=True)
    assert before.free_slots() == [0]


# ---- bad state is contained ------------------------------------------------------------------------


def _break(folder: Path, **changes: object) -> None:
    meta = json.loads((folder / run_reader.RUN_FILE).read_text())
    meta.update(changes)
    (folder / run_reader.RUN_FILE).write_text(json.dumps(meta))


@pytest.mark.timeout(180)
def test_malformed_run_folders_are_passed_over_by_name_and_never_stop_a_new_sweep(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    fn = job(stream_output=False)(plus_one)
    made = []
    for n in range(5):
        results = fn.map([n, n + 10], progress=False)
        assert list(results) == [n + 1, n + 11]
        made.append(runs_dir() / str(results.run_id))
    _break(made[0], started="yesterday")
    _break(made[1], pid="x", cells=[1, 2])
    (made[2] / run_reader.RUN_FILE).write_text('{"format": 1, "star')  # cut short
    with open(made[3] / run_reader.EVENTS_FILE, "a") as events:
        events.write('{"i": "zero", "state": "done", "t": 1}\n[1, 2]\n{"i": 0, "state": "sleeping", "t": 1}\n')
    bad = made[:3]

    assert list(fn.map([1, 2], progress=False)) == [2, 3]
    assert fn.remote(7) == 8
    with caplog.at_level(logging.WARNING, logger="levers9"):
        assert list(fn.map([0, 10], progress=False, resume=True)) == [1, 11]
    assert all(any(str(folder) in line for line in _warnings(caplog)) for folder in bad)

    status, out, err = _cli(capsys, "runs")
    assert status == 0 and made[3].name in out and made[4].name in out
    skipped = err.strip().splitlines()
    assert len(skipped) == 3 and all(any(str(f) in line for line in skipped) for f in bad), err
    assert "'started' must be a time" in err and "'yesterday'" in err and f"rm -r {made[0]}" in err

    status, out, err = _cli(capsys, "runs", "show", made[0].name)
    assert status == 2 and "'yesterday'" in err and f"rm -r {made[0]}" in err
    status, out, err = _cli(capsys, "runs", "show", made[3].name)
    assert status == 0 and "done" in out and "skipped 3 line(s)" in err

    status, out, err = _cli(capsys, "runs", "clean", "--keep", "100")
    assert status == 0 and len(err.strip().splitlines()) == 3
    assert all(folder.exists() for folder in made)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("text", "key", "value", "command", "check"),
    [
        ("workspace = 5\n", "workspace", "5", ["multi-gpu", "on"], lambda s: s.multi_gpu),
        ('limits = "x"\n', "limits", "'x'", ["max-gpu-count", "3"], lambda s: s.max_gpu_count == 3),
        ('[workspace]\nmulti_gpu = "yes"\n', "multi_gpu", "'yes'", ["multi-gpu", "on"], lambda s: s.multi_gpu),
        ("[limits]\nmax_gpu_count = 0\n", "max_gpu_count", "0", ["max-gpu-count", "2"], lambda s: s.max_gpu_count == 2),
    ],
)
def test_a_bad_setting_names_file_key_value_and_a_command_that_repairs_the_file(
    text: str, key: str, value: str, command: list[str], check: Callable[..., bool],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    path = settings_path()
    path.write_text("# mine\n" + text)
    with pytest.raises(SettingsError) as caught:
        job(stream_output=False)(plus_one).remote(1)  # every call reads the settings
    message = str(caught.value)
    assert str(path) in message and key in message and value in message
    fix = f"levers9 workspace {command[0]}"
    assert fix in message
    status, out, err = _cli(capsys, "workspace", *command)
    assert status == 0, err
    assert check(load_settings()) and path.read_text().startswith("# mine\n")
    assert job(stream_output=False)(plus_one).remote(1) == 2


# ---- concurrent callers ------------------------------------------------------------------------------


CALLER = """
import sys
from levers9 import job
from tests.test_faults_state import plus_one

fn = job(stream_output=False)(plus_one)
failed = 0
for n in range(int(sys.argv[1])):
    try:
        assert fn.remote(n) == n + 1
    except Exception as exc:
        failed += 1
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
print(failed)
"""


@pytest.mark.timeout(290)
def test_a_retention_of_one_never_removes_another_callers_run(tmp_path: Path) -> None:
    env = _env(LEVERS9_KEEP_RUNS="1")
    callers = [
        subprocess.Popen([sys.executable, "-c", CALLER, "30"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
        for _ in range(4)
    ]
    outcomes = [caller.communicate(timeout=280) for caller in callers]
    for caller, (out, err) in zip(callers, outcomes, strict=True):
        assert caller.returncode == 0 and out.strip() == "0", err[-2000:]
    left = [p.name for p in runs_dir().iterdir()]
    assert left and not any(n.startswith(".") for n in left), left  # no half-made folder left behind
    run_folder.clean(keep=1)
    assert len(list(runs_dir().iterdir())) == 1


# ---- another user ----------------------------------------------------------------------------------


def _as_other_user(script: str) -> None:
    """Run `script` (Python) in a forked child that has become uid/gid OTHER_UID."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            os.umask(0o022)
            exec(script, {"Path": Path, "os": os})
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    """A folder like /tmp (root's, mode 1777) that OTHER_UID can reach: under a folder of ours in /tmp
    that others may pass through (0711), removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="levers9-test-shared-"))
    try:
        base.chmod(0o711)
        shared = base / "shared"
        shared.mkdir()
        shared.chmod(0o1777)
        yield shared
    finally:
        shutil.rmtree(base)


@pytest.mark.timeout(60)
def test_a_workspace_file_another_user_made_first_is_refused_not_obeyed(
    shared_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = shared_folder
    monkeypatch.delenv("LEVERS9_CONFIG_DIR")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(shared))
    _as_other_user(textwrap.dedent(f"""
        folder = Path({str(shared / "levers9")!r})
        folder.mkdir(mode=0o755)
        (folder / "workspace.toml").write_text("[workspace]\\nmulti_gpu = true\\n[limits]\\nmax_gpu_count = 1024\\n")
    """))
    with pytest.raises(PrivateDirError) as caught:
        load_settings()
    assert f"{shared / 'levers9'} belongs to uid {OTHER_UID}" in str(caught.value)
    assert "LEVERS9_CONFIG_DIR" in str(caught.value)
    status, _, err = _cli(capsys, "workspace", "multi-gpu", "on")
    assert status == 1 and "LEVERS9_CONFIG_DIR" in err
    assert not (shared / "levers9" / "workspace.toml.lock").exists()
    # the fix it names works
    mine = tmp_path / "mine"
    monkeypatch.setenv("LEVERS9_CONFIG_DIR", str(mine))
    assert load_settings().multi_gpu is False
    status, _, err = _cli(capsys, "workspace", "multi-gpu", "on")
    assert status == 0 and load_settings().multi_gpu is True


@pytest.mark.timeout(60)
def test_another_users_file_a_fifo_or_a_symlink_in_the_config_folder_is_refused_without_hanging(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = settings_path()
    path.write_text("[workspace]\nmulti_gpu = true\n")
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(SettingsError, match=f"belongs to uid {OTHER_UID}.*rm {path}.*LEVERS9_CONFIG_DIR"):
        load_settings()
    path.unlink()
    os.mkfifo(path)
    started = time.monotonic()
    with pytest.raises(SettingsError, match="is not a regular file \\(it is a FIFO\\)"):
        job(stream_output=False)(plus_one).remote(1)
    assert time.monotonic() - started < 10
    path.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    lock = Path(str(path) + ".lock")
    lock.symlink_to(elsewhere / "planted")
    status, _, err = _cli(capsys, "workspace", "multi-gpu", "on")
    assert status == 1 and f"rm {lock}" in err
    assert list(elsewhere.iterdir()) == []  # nothing was created through the link
    lock.unlink()
    assert _cli(capsys, "workspace", "multi-gpu", "on")[0] == 0 and load_settings().multi_gpu is True


@pytest.mark.timeout(120)
def test_a_run_another_user_owns_is_neither_listed_nor_reused(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    fn = job(stream_output=False)(plus_one)
    results = fn.map([1], progress=False)
    assert list(results) == [2]
    folder = runs_dir() / str(results.run_id)
    os.chown(folder / run_reader.RUN_FILE, OTHER_UID, OTHER_UID)
    status, out, err = _cli(capsys, "runs")
    assert status == 0 and folder.name not in out
    assert f"belongs to uid {OTHER_UID}" in err and f"rm -r {folder}" in err
    with caplog.at_level(logging.WARNING, logger="levers9"):
        again = fn.map([1], progress=False, resume=True)
        assert list(again) == [2]
    assert (runs_dir() / str(again.run_id) / run_reader.EVENTS_FILE).read_text().count('"reused"') == 0


# ---- a HOME that is not writable -------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_an_unwritable_home_is_an_error_naming_the_variables_that_move_the_state(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("LEVERS9_STATE_DIR", "XDG_CACHE_HOME", "LEVERS9_CONFIG_DIR", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "/sys/kernel")  # not writable, even by root
    fn = job(stream_output=False)(plus_one)
    with pytest.raises(PrivateDirError) as caught:
        fn.remote(1)
    message = str(caught.value)
    assert "/sys/kernel/.cache" in message and "LEVERS9_STATE_DIR" in message and "XDG_CACHE_HOME" in message
    assert load_settings().multi_gpu is False  # reading settings needs no folder
    status, _, err = _cli(capsys, "workspace", "multi-gpu", "on")
    assert status == 1 and "LEVERS9_CONFIG_DIR" in err and "XDG_CONFIG_HOME" in err
    # no HOME at all, as a user with no passwd entry: the same variables, from a child that is that user
    monkeypatch.delenv("HOME")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            runs_dir()
            os.write(write, b"no error")
        except Exception as exc:
            os.write(write, f"{type(exc).__name__}: {exc}".encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as said:
        text = said.read()
    assert text.startswith("ConfigError") and "LEVERS9_STATE_DIR or XDG_CACHE_HOME" in text, text


# ---- bad seconds -------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["timeout", "stop_grace", "queue_timeout", "stall_timeout"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0])
def test_job_refuses_nan_infinite_and_negative_seconds_by_name(name: str, value: float) -> None:
    with pytest.raises(JobConfigError) as caught:
        job(**{name: value})(plus_one)  # type: ignore[call-overload]
    message = str(caught.value)
    assert message.startswith(f"{name} must be") and repr(value) in message and f"@job({name}=" in message


@pytest.mark.timeout(60)
def test_runs_logs_never_waits_on_a_fifo_nor_follows_a_symlink(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = job()(chatty).map([2], progress=False)
    assert list(results) == [2]
    attempt = runs_dir() / str(results.run_id) / "0000-1"
    (attempt / "stdout.log").unlink()
    os.mkfifo(attempt / "stdout.log")
    secret = tmp_path / "secret"
    secret.write_text("not a log\n")
    (attempt / "stderr.log").unlink()
    (attempt / "stderr.log").symlink_to(secret)
    started = time.monotonic()
    status, out, err = _cli(capsys, "runs", "logs", str(results.run_id), "0")
    assert status == 0 and time.monotonic() - started < 10
    assert "not a log" not in out and "not a regular file (it is a FIFO)" in err and "symlink" in err
