"""Folders at predictable paths are ours alone: another user's folder, a symlink, or a folder others can
write is refused before levers9 puts a lock or reads a result there."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from levers9.errors import PrivateDirError
from levers9.launch import job
from levers9.private_dir import private_dir
from tests import jobfns
from tests.proc_util import remove_shm_boards_if_empty

pytestmark = pytest.mark.procs

NOBODY = pwd.getpwnam("nobody").pw_uid


@pytest.fixture
def shared_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A stand-in for /tmp (mode 1777) that levers9 uses as the temp dir, with no state dir set."""
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    monkeypatch.delenv("LEVERS9_STATE_DIR")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("LEVERS9_SIMULATE_GPUS", "RTXPro6000:2")
    return shared


def _gpu_job() -> object:
    return job(gpu="RTXPro6000", stream_output=False)(jobfns.add)


@pytest.mark.skipif(
    os.getuid() != 0, reason="creating a folder as another user needs root; the symlink case covers the rest"
)
@pytest.mark.timeout(60)
def test_a_lease_folder_another_user_created_first_is_refused(shared_tmp: Path) -> None:
    planted = shared_tmp / f"levers9-{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(PrivateDirError) as info:
        _gpu_job().remote(1, 2)  # type: ignore[attr-defined]
    message = str(info.value)
    assert str(planted) in message and "nobody" in message and "LEVERS9_STATE_DIR" in message
    assert list(planted.iterdir()) == []  # no lock file of ours ended up in their folder


@pytest.mark.timeout(60)
def test_a_symlink_planted_at_the_lease_path_is_refused(shared_tmp: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    planted = shared_tmp / f"levers9-{os.getuid()}"
    planted.symlink_to(target)
    with pytest.raises(PrivateDirError, match="symlink"):
        _gpu_job().remote(1, 2)  # type: ignore[attr-defined]
    assert list(target.iterdir()) == []


@pytest.mark.timeout(60)
def test_a_job_in_a_clean_temp_dir_makes_its_folders_0700(shared_tmp: Path) -> None:
    assert _gpu_job().remote(1, 2) == 3  # type: ignore[attr-defined]
    ours = shared_tmp / f"levers9-{os.getuid()}"
    for folder in (ours, ours / "leases"):
        info = os.lstat(folder)
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (os.getuid(), 0o700)


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o702])
def test_a_folder_of_ours_that_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(PrivateDirError, match=f"writable by others \\(mode {mode:04o}\\)"):
        private_dir(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == mode  # refused, not silently changed


def test_a_folder_of_ours_that_others_can_only_read_is_tightened_to_0700(tmp_path: Path) -> None:
    folder = tmp_path / "readable"
    folder.mkdir()
    folder.chmod(0o755)
    assert private_dir(folder) == folder
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


@pytest.mark.timeout(60)
def test_a_state_dir_others_can_write_is_refused_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    state = tmp_path / "lab-shared"
    state.mkdir()
    state.chmod(0o777)
    monkeypatch.setenv("LEVERS9_STATE_DIR", str(state))
    marker = tmp_path / "ran"
    with pytest.raises(PrivateDirError, match="lab-shared.*writable by others"):
        job(stream_output=False)(jobfns.touch).remote(str(marker))
    assert not marker.exists() and list(state.iterdir()) == []


@pytest.mark.skipif(os.getuid() != 0, reason="creating a folder as another user needs root")
def test_a_state_dir_inside_another_users_folder_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(PrivateDirError, match="belongs to nobody"):
        private_dir(theirs / "state" / "runs")
    assert list(theirs.iterdir()) == []


@pytest.mark.parametrize("kind", ["ray", "slurm"])
def test_a_tasks_scratch_refuses_a_planted_symlink(shared_tmp: Path, tmp_path: Path, kind: str) -> None:
    from levers9.launch.job_process import scratch_dir

    target = tmp_path / "theirs"
    target.mkdir()
    (shared_tmp / f"levers9-{kind}-{os.getuid()}").symlink_to(target)
    with pytest.raises(PrivateDirError, match="symlink"):
        scratch_dir(kind, 0, 1)
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("state_dir", [True, False], ids=["LEVERS9_STATE_DIR", "dev-shm"])
def test_stall_boards_live_in_a_private_folder(monkeypatch: pytest.MonkeyPatch, state_dir: bool) -> None:
    """In $LEVERS9_STATE_DIR/boards when that is set (the fix errors name must work), else /dev/shm/levers9-<uid>."""
    from levers9.distributed import stalls

    if not state_dir:
        monkeypatch.delenv("LEVERS9_STATE_DIR")
    folder = stalls.BoardFolder(2)
    try:
        root = os.lstat(folder.path.parent)
        expected = "boards" if state_dir else f"levers9-{os.getuid()}"
        assert folder.path.parent.name == expected
        assert (root.st_uid, stat.S_IMODE(root.st_mode), stat.S_ISDIR(root.st_mode)) == (os.getuid(), 0o700, True)
    finally:
        folder.remove()
        remove_shm_boards_if_empty()


def test_a_board_that_cannot_be_mapped_leaves_no_folder_behind(tmp_path: Path) -> None:
    """Out of descriptors with one left: the board file opens, but its map (a dup of that descriptor) cannot
    be made. The error says what ran out and how to fix it, and the half-made board folder is removed."""
    code = textwrap.dedent("""
        import os, resource
        from levers9.distributed import stalls
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            os.close(held.pop())  # exactly one descriptor free
        try:
            stalls.BoardFolder(2)
        except OSError as exc:
            print("refused:", exc)
    """)
    state = tmp_path / "state"
    env = {**os.environ, "LEVERS9_STATE_DIR": str(state)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "could not open and map its board file" in done.stdout, done.stdout
    assert "ulimit -n" in done.stdout
    assert list((state / "boards").iterdir()) == []  # the folder it made is gone


def test_a_board_folder_makes_only_the_place_it_goes_in_and_looking_makes_none(
    shared_tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, every run with timeout= made a private folder at every place a board may go (the state folder,
    /dev/shm and the temp dir), and `levers9 stacks` made them only to look in them: an empty
    /tmp/levers9-<uid> was left behind by runs whose boards were elsewhere."""
    from levers9.distributed import stalls

    state = tmp_path / "state"
    monkeypatch.setenv("LEVERS9_STATE_DIR", str(state))
    assert list(stalls.live_boards()) == [] and stalls.find_board(os.getpid()) is None
    assert not state.exists()  # looking made nothing
    folder = stalls.BoardFolder(2)
    try:
        assert folder.path.parent == state / "boards"
        assert not (shared_tmp / f"levers9-{os.getuid()}").exists()  # the temp dir's place was not reached
    finally:
        folder.remove()
