"""Files levers9 keeps in its state folder, written so that a full disk costs only what could not be kept.

Files are this user's alone (0600) and never written or read through a symlink. A write that fails for lack
of space (ENOSPC, EDQUOT) is reported as a full state folder; any other OSError by its own words. Neither ever
fails a job: the state folder only records what jobs do (`Losses` says in one warning what a run lost).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from levers9.procs import fds

log = logging.getLogger("levers9.launch")

FULL = (errno.ENOSPC, errno.EDQUOT)
MOVE_IT = "Free space there, or set LEVERS9_STATE_DIR to a folder on a disk with room"
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC
ROOM_PROBE = 1 << 20  # bytes room_for writes: room for a job's result and some output


def room_for(folder: Path, nbytes: int = ROOM_PROBE) -> OSError | None:
    """The error that writing `nbytes` into `folder` meets on a full disk or a quota (errno in FULL), else None
    (the folder missing or any other error included); the probe file is removed either way."""
    probe = folder / f".room-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(probe, "wb") as handle:
            handle.write(bytes(nbytes))
            handle.flush()
            os.fsync(handle.fileno())  # a network file system may say so only here
    except OSError as exc:
        return exc if exc.errno in FULL else None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


class StateFileError(OSError):
    """A file levers9 reads back is not a regular file of this user's (a symlink, a FIFO, someone else's)."""


def why(exc: OSError) -> str:
    """'is full (No space left on device)', or 'cannot be written (Permission denied)'."""
    text = exc.strerror or (os.strerror(exc.errno) if exc.errno else str(exc))
    return f"is full ({text})" if exc.errno in FULL else f"cannot be written ({text})"


def write_atomic(path: Path, blob: bytes, *, pad: int = 0, durable: bool = False) -> None:
    """Write `blob` (then `pad` spaces and a newline, room a later in-place rewrite may grow into) to
    `path` so that readers see the old file or the new one, whole; readable by this user only. With
    `durable`, the file and its folder are synced to disk before this returns. On OSError nothing new
    is left behind (the old file stays) and the error is raised."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
    data = blob + (b" " * pad + b"\n" if pad else b"")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(partial)  # left by a crash of this very thread id; ours (the folder is private)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600)
    try:
        with open(fd, "wb") as handle:
            handle.write(data)
            if durable:
                handle.flush()
                os.fsync(fd)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    if durable:
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def overwrite_in_place(path: Path, blob: bytes) -> bool:
    """Rewrite `path` in the space it already takes (blob, then spaces to its old size), which needs no
    free block; False if `blob` does not fit or the write fails. Not atomic: only for a last word."""
    try:
        fd = os.open(path, os.O_WRONLY | _OPEN_FLAGS)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        if len(blob) + 1 > size:
            return False
        data = blob + b" " * (size - len(blob) - 1) + b"\n"
        return os.pwrite(fd, data, 0) == len(data)
    except OSError:
        return False
    finally:
        os.close(fd)


def read_private(path: Path, limit: int = 64 << 20) -> bytes:
    """The bytes of `path`, a regular file owned by this user that others cannot write. FileNotFoundError
    if it is missing; StateFileError if it is a symlink, a FIFO or device, someone else's, or over `limit`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StateFileError(errno.ELOOP, f"{path} is a symlink; levers9 reads only real files") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StateFileError(errno.EINVAL, f"{path} is not a regular file (it is {_kind(info.st_mode)})")
        if info.st_uid != os.getuid():
            raise StateFileError(errno.EPERM, f"{path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()})")
        if info.st_mode & 0o022:
            raise StateFileError(errno.EPERM, f"{path} is writable by others (mode {stat.S_IMODE(info.st_mode):04o})")
        if info.st_size > limit:
            raise StateFileError(errno.EFBIG, f"{path} holds {info.st_size} bytes, more than {limit}")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


@contextlib.contextmanager
def held(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on the lock file `path` (made 0600 if missing) while the body runs; the
    descriptor is one of levers9's tracked ones (procs/fds.py), so no forked child keeps the lock."""
    fd = fds.open_fd(str(path), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fds.close(fd)


def lock_now(fd: int, *, shared: bool = False) -> bool:
    """Take an flock on `fd` (exclusive, or `shared`) without waiting: True if taken, False if another
    process holds it; any other OSError is raised."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        return False
    return True


def hold_new(path: Path, blob: bytes) -> int:
    """Write `blob` to the lock file `path` (made 0600, emptied first, never through a symlink) and take
    its exclusive flock without waiting; the descriptor that holds it is returned (tracked, as `held`'s).
    On OSError (the lock is taken, the disk is full) the file is removed again and the error raised."""
    fd = fds.open_fd(str(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.write(fd, blob) != len(blob):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        fds.close(fd)
        raise
    return fd


class Losses:
    """What one run folder could not keep (its output, results, record), said in one warning: by `report()` when
    the run closes, or at once by `unrecorded_run` when the run could not be recorded at all. Each run folder
    (launch/run_folder.py's RunFolder) holds its own, handed to whatever writes there."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = threading.Lock()
        self.error: OSError | None = None  # the first failed write
        self.unrecorded = False  # the run has no record at all (already said, at its start)
        self.output_bytes = 0
        self.output_files: list[Path] = []
        self.results: list[int] = []  # cell indexes
        self.other: dict[str, int] = {}  # what else -> how many
        self.end_lost = False

    @contextlib.contextmanager
    def _losing(self, exc: OSError) -> Iterator[None]:
        """Count a loss under the lock (the body says what), keeping the first error for the warning."""
        with self._lock:
            if self.error is None:
                self.error = exc
            yield

    def lost_output(self, path: Path, nbytes: int, exc: OSError) -> None:
        with self._losing(exc):
            self.output_bytes += nbytes
            if path not in self.output_files:
                self.output_files.append(path)

    def lost_result(self, index: int, exc: OSError) -> None:
        with self._losing(exc):
            self.results.append(index)

    def lost(self, what: str, exc: OSError) -> None:
        """Something else of the record, named by a noun that takes an 's' ('meta.json file')."""
        with self._losing(exc):
            self.other[what] = self.other.get(what, 0) + 1

    def lost_end(self, exc: OSError) -> None:
        with self._losing(exc):
            self.end_lost = True

    def unrecorded_run(self, root: Path, run_id: str, exc: OSError) -> None:
        """The run folder could not be made: say so now, in one line, and stay quiet after."""
        with self._losing(exc):
            self.unrecorded = True
        log.warning(
            "the state folder %s %s: run %s is not recorded (no logs, and resume will not find its "
            "results); its cells run anyway. %s.", root, why(exc), run_id, MOVE_IT,
        )

    def report(self) -> None:
        """One warning naming what was lost and where, if anything was (and the run was recorded)."""
        with self._lock:
            if self.error is None or self.unrecorded:
                return
            parts = []
            if self.output_bytes or self.output_files:
                files = len(self.output_files)
                parts.append(
                    f"{_size(self.output_bytes)} of job output ({files} log file{'s' * (files != 1)}, "
                    f"e.g. {self.output_files[0]}, cut short where the disk filled)"
                )
            if self.results:
                cells = ", ".join(f"#{i}" for i in sorted(self.results))
                parts.append(
                    f"the result{'s' * (len(self.results) > 1)} of cell{'s' * (len(self.results) > 1)} {cells} "
                    f"(returned to you, but resume will not find them)"
                )
            parts += [f"{n} {what}{'s' * (n > 1)}" for what, n in self.other.items()]
            if self.end_lost:
                parts.append("the run's end (levers9 runs shows it as interrupted)")
            error, self.error = self.error, None
        log.warning("the run folder %s %s; lost %s. %s.", self.folder, why(error), "; ".join(parts), MOVE_IT)


class AppendLog:
    """An append-only log file (0600, never through a symlink) that never raises: once a write fails,
    what is written after is handed to `lost` (path, bytes, the error) instead: given a Losses, counted
    there as job output lost."""

    def __init__(self, path: Path, lost: Losses | Callable[[Path, int, OSError], None]) -> None:
        self.path = path
        self.lost = lost.lost_output if isinstance(lost, Losses) else lost
        self.fd: int | None = None
        self.error: OSError | None = None
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | _OPEN_FLAGS, 0o600)
        except OSError as exc:
            self.error = exc

    def write(self, data: bytes) -> None:
        """Append `data` (all of it, or count what could not be written)."""
        if self.fd is not None and self.error is None:
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(self.fd, view) :]
                return
            except OSError as exc:
                self.error = exc
                data = bytes(view)
        if self.error is not None:
            self.lost(self.path, len(data), self.error)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> AppendLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):  # fmt: skip
        if test(mode):
            return name
    return f"mode {mode:o}"
