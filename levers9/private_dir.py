"""Folders at predictable paths that belong to this user alone.

Every folder levers9 creates at a path another user could guess (card leases and Ray scratch under the temp
dir, run folders, stall boards, $LEVERS9_STATE_DIR) goes through `private_dir`. On a shared machine another
user could create that path first (a folder of theirs, or a symlink to one) and then hold our lock files,
delete them, or plant a result file that we would unpickle. So the folder is created with mkdir(mode=0o700)
(never through a symlink at its own path), then checked with lstat:

- a real directory, not a symlink, owned by the current user;
- not writable by group or others: one of ours merely readable by others is tightened to 0700 (nobody else
  could have written into it), one others could write into is refused (files may already be planted in it);
- every folder above it that sits in a folder others may write (such as /tmp/levers9-<uid>) passes the same
  checks; any other is owned by root or us, and writable by others only if sticky (as /tmp is).

Anything else is a PrivateDirError naming the folder, its owner and mode, and the fix.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from pathlib import Path

from levers9.errors import PrivateDirError

FIX = "set LEVERS9_STATE_DIR to a folder of your own (e.g. ~/.levers9-state), or remove the folder"


def private_dir(path: Path | str, fix: str = FIX) -> Path:
    """`path`, created if missing (with missing parents), once it is a real directory owned by this
    user with mode 0700; PrivateDirError if it is anyone else's, a symlink, or writable by others, or
    if it cannot be created for want of permission (`fix` says what to do instead; its `errno` is then
    set, as it is on no refusal of a folder someone else holds). A full disk is the OSError itself
    (ENOSPC), which callers that only record may pass over."""
    path = Path(os.path.abspath(os.path.expanduser(path)))
    _check_ancestors(path.parent, fix)
    if not path.parent.exists():
        private_dir(path.parent, fix)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR):
            raise
        error = PrivateDirError(
            f"cannot create {path} ({exc.strerror}): levers9 keeps its state there and needs a folder it can "
            f"write. Fix: {fix}."
        )
        error.errno = exc.errno  # a folder that cannot be written, not one someone else holds
        raise error from None
    info = os.lstat(path)
    _check_ours(path, info, fix)
    if stat.S_IMODE(info.st_mode) != 0o700:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
                raise PrivateDirError(f"{path} was replaced while levers9 checked it. Fix: {fix}.")
            os.fchmod(fd, 0o700)  # the folder just checked, never what a symlink swapped in points at
        finally:
            os.close(fd)
    return path


def check_private(path: Path | str, fix: str = FIX) -> bool:
    """True if `path` is a folder of ours alone (as private_dir would leave it, but never created or
    changed here), False if it does not exist; PrivateDirError otherwise."""
    path = Path(os.path.abspath(os.path.expanduser(path)))
    _check_ancestors(path.parent, fix)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    _check_ours(path, info, fix)
    return True


def _check_ours(path: Path, info: os.stat_result, fix: str = FIX) -> None:
    """Refuse `path` unless it is a real folder owned by this user that others cannot write."""
    if stat.S_ISLNK(info.st_mode):
        raise PrivateDirError(
            f"{path} is a symlink (owned by {_owner(info.st_uid)}, pointing at {os.readlink(path)}); levers9 "
            f"keeps its lock and result files only in a real folder of its own. Fix: {fix}."
        )
    if not stat.S_ISDIR(info.st_mode):
        raise PrivateDirError(
            f"{path} exists and is not a folder (owned by {_owner(info.st_uid)}). Fix: {fix}."
        )
    if info.st_uid != os.getuid():
        raise PrivateDirError(
            f"{path} belongs to {_owner(info.st_uid)}, not to you ({_owner(os.getuid())}); another user created "
            f"it first and could hold or plant files in it. Expected a folder owned by you, mode 0700. Fix: {fix}."
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        raise PrivateDirError(
            f"{path} is yours but writable by others (mode {mode:04o}), so files in it may have been planted. "
            f"Expected mode 0700. Fix: remove it (levers9 recreates it as 0700), or {fix}."
        )


def _check_ancestors(folder: Path, fix: str = FIX) -> None:
    """Refuse `folder` or any folder above it that is not safe to keep private folders under (see above)."""
    me = os.getuid()
    for ancestor in (folder, *folder.parents):
        try:
            info = os.lstat(ancestor)
        except FileNotFoundError:
            continue
        if ancestor != ancestor.parent and os.stat(ancestor.parent).st_mode & 0o022:
            _check_ours(ancestor, info, fix)  # anyone could have created it: only a folder of ours will do
            continue
        if info.st_uid not in (0, me):
            raise PrivateDirError(
                f"{ancestor} belongs to {_owner(info.st_uid)}, so that user could replace what levers9 keeps "
                f"below it. Expected folders owned by you or root. Fix: {fix}."
            )
        if stat.S_ISLNK(info.st_mode):
            _check_ancestors(Path(os.path.realpath(ancestor)), fix)
            continue
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            raise PrivateDirError(
                f"{ancestor} is writable by others (mode {stat.S_IMODE(info.st_mode):04o}, not sticky), so "
                f"another user could replace what levers9 keeps below it. Fix: {fix}."
            )


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
