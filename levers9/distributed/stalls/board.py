"""A run's board folder (`BoardFolder`, the parent's side) and the progress board in it: one slot per rank.

A rank (`RankSlot`) writes the first part of its slot whenever it enters or leaves a `torch.distributed`
call from Python (how many it finished, whether it is in one now, which, and since when, on the
machine-wide monotonic clock); its sampler thread writes the second part from torch's flight recorder
(collectives issued and completed, whoever issued them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import mmap
import os
import pickle
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from levers9.errors import ConfigError, PrivateDirError
from levers9.private_dir import check_private, private_dir
from levers9.procs.watch import pid_alive

_CALLS = struct.Struct("=QQdd24s")  # finished, in_collective, entered_at, last_finished_at, name
_RECORDER = struct.Struct("=qqdd40s")  # issued (-1: unknown), completed, changed_at, sampled_at, pending
_SLOT_SIZE = _CALLS.size + _RECORDER.size
# While no Python-level collective moved for this long, the parent asks for recorder samples this often.
QUIET_S = 1.0
BOARD_DIR_PREFIX = "levers9-board-"


def board_roots() -> list[Path]:
    """The places board folders of this user's runs are now, best first: folders of ours alone that exist (none
    is made only to be looked in); another user's folder, or a symlink, at one of them is passed over."""
    found = []
    for place in _board_places():
        with contextlib.suppress(PrivateDirError):
            if check_private(place):
                found.append(place)
    return found


def _usable_places() -> Iterator[Path]:
    """Each place a board folder may go, best first, made a private folder only once it is reached; one that
    cannot be (a full or read-only state folder, another user's folder) is passed over. PrivateDirError naming
    every reason when none can be."""
    places, errors = _board_places(), []
    for place in places:
        try:
            yield private_dir(place)
        except OSError as exc:  # another user's folder, a symlink, a full or read-only disk: try the next place
            errors.append(str(exc))
    if len(errors) == len(places):
        raise PrivateDirError(
            "distributed.run has nowhere private for its board folder (timeout=/stall_timeout= reports): "
            + " ".join(errors) + " Set LEVERS9_STATE_DIR to a folder of your own (e.g. export "
            "LEVERS9_STATE_DIR=~/.cache/levers9)."
        )


def _board_places() -> list[Path]:
    """$LEVERS9_STATE_DIR/boards when that is set, then /dev/shm/levers9-<uid>, then <temp dir>/levers9-<uid>."""
    state = os.environ.get("LEVERS9_STATE_DIR")
    shm = Path("/dev/shm")
    bases = ([shm] if shm.is_dir() and os.access(shm, os.W_OK) else []) + [Path(tempfile.gettempdir())]
    return ([Path(state).expanduser() / "boards"] if state else []) + [b / f"levers9-{os.getuid()}" for b in bases]


@dataclasses.dataclass(frozen=True)
class SlotState:
    """One rank's collective progress as last written.

    The first five fields count `torch.distributed` calls made from Python; the `recorder_` ones are
    torch's flight recorder's counts of every collective (-1 when the recorder is off or unread).
    """

    finished: int
    in_collective: bool
    entered_at: float
    last_finished_at: float
    name: str
    recorder_issued: int = -1
    recorder_completed: int = -1
    recorder_changed_at: float = 0.0
    recorder_sampled_at: float = 0.0
    pending: str = ""

    @property
    def recorder_known(self) -> bool:
        return self.recorder_issued >= 0

    @property
    def waiting_for_issued(self) -> bool:
        """It issued a collective that has not completed (NCCL's enqueued work included)."""
        return self.recorder_issued > self.recorder_completed


class BoardFolder:
    """The parent's side: creates the folder and the progress board, reads them, removes them."""

    def __init__(self, nprocs: int) -> None:
        self.path = _new_board_folder(nprocs)
        board = self.path / "progress.bin"
        try:
            self._file, self._map = _map_board(board, nprocs)
        except OSError:  # no descriptor or memory left: the half-made folder (the board alone) goes, by name,
            with contextlib.suppress(OSError):  # since listing it would need a descriptor
                board.unlink()
                self.path.rmdir()
            raise
        for rank in range(nprocs):
            try:
                os.mkfifo(sample_fifo(self.path, rank), 0o600)
            except OSError:  # a filesystem without FIFOs: no recorder samples, the Python-level counts remain
                break
        self.nprocs = nprocs
        self._last_request = 0.0
        self.pids: list[int] = []  # the ranks' pids, by slot, once started

    def write_pids(self, parent: int, pids: list[int]) -> None:
        self.pids = list(pids)
        (self.path / "ranks.json").write_text(json.dumps({"parent": parent, "pids": pids}))

    def stopped(self) -> set[int]:
        """Slots whose rank is stopped now (SIGSTOP, a debugger): such a rank answers no request."""
        return {slot for slot, pid in enumerate(self.pids) if is_stopped(pid)}

    def states(self) -> list[SlotState]:
        return [read_slot(self._map, rank) for rank in range(self.nprocs)]

    def sample_when_quiet(self, states: list[SlotState], now: float) -> None:
        """Ask every rank for a recorder sample, at most once per QUIET_S, while no Python-level call moved."""
        python_moved = max(max(s.entered_at, s.last_finished_at) for s in states)
        if now - python_moved >= QUIET_S and now - self._last_request >= QUIET_S:
            self._last_request = now
            request_samples(self.path, range(self.nprocs))

    def fresh_states(self, ranks: list[int]) -> list[SlotState]:
        """The board after fresh samples from `ranks`, not waiting for a stopped rank's (it cannot answer)."""
        stopped = self.stopped()
        return fresh_states(self.path, [r for r in ranks if r not in stopped], self.states)

    def remove(self) -> None:
        self._map.close()
        self._file.close()
        shutil.rmtree(self.path, ignore_errors=True)


def _new_board_folder(nprocs: int) -> Path:
    """A fresh folder with an empty board in the first place with room for it (a full /dev/shm moves it on)."""
    failures = []
    for root in _usable_places():
        remove_stale_runs(root)
        try:
            path = Path(tempfile.mkdtemp(prefix=f"{BOARD_DIR_PREFIX}{os.getpid()}-", dir=root))
        except OSError as exc:  # a full or read-only state folder: the next root
            failures.append(f"{root}: {exc.strerror or exc}")
            continue
        now = time.monotonic()
        try:
            with open(path / "progress.bin", "wb") as f:
                for _ in range(nprocs):
                    f.write(_CALLS.pack(0, 0, 0.0, now, b"") + _RECORDER.pack(-1, -1, now, 0.0, b""))
            return path
        except OSError as exc:  # ENOSPC: a full or tiny /dev/shm
            shutil.rmtree(path, ignore_errors=True)
            failures.append(f"{root}: {exc.strerror or exc}")
    raise OSError(
        f"distributed.run could not write its board folder (for timeout=/stall_timeout= reports) in "
        f"{'; '.join(failures)}. Expected a few hundred bytes free; free space there, or set LEVERS9_STATE_DIR "
        f"to a folder of your own with room."
    )


def _map_board(board: Path, nprocs: int) -> tuple[BinaryIO, mmap.mmap]:
    """The board file, open and mapped (kept open: BoardFolder.remove closes it); OSError saying what ran out."""
    with contextlib.ExitStack() as opened:
        try:
            file = opened.enter_context(open(board, "r+b"))
            board_map = mmap.mmap(file.fileno(), _SLOT_SIZE * nprocs)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"distributed.run could not open and map its board file {board} ({exc.strerror or exc}). Expected "
                f"a free file descriptor and a page of memory; close files or raise their limit (ulimit -n).",
            ) from exc
        opened.pop_all()
        return file, board_map


def remove_stale_runs(root: Path) -> None:
    """Remove board folders in `root` whose caller no longer exists (it was killed outright, so it could not)."""
    for folder in root.glob(f"{BOARD_DIR_PREFIX}*"):
        pid_text = folder.name[len(BOARD_DIR_PREFIX) :].split("-", 1)[0]
        if pid_text.isdigit() and not pid_alive(int(pid_text)):
            shutil.rmtree(folder, ignore_errors=True)


def is_stopped(pid: int) -> bool:
    """True if process `pid` is stopped (state T, by SIGSTOP or job control) or held by a debugger (t)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
    except OSError:
        return False
    return bool(fields) and fields[0] in (b"T", b"t")


def read_slot(board: mmap.mmap, rank: int) -> SlotState:
    offset = rank * _SLOT_SIZE
    finished, busy, entered, last, name = _CALLS.unpack_from(board, offset)
    issued, completed, changed_at, sampled_at, pending = _RECORDER.unpack_from(board, offset + _CALLS.size)
    return SlotState(
        finished, bool(busy), entered, last, _text(name), issued, completed, changed_at, sampled_at, _text(pending)
    )


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode(errors="replace")


class RankSlot:
    """A rank's side: records entering and leaving collectives, and the recorder's counts, in its slot."""

    def __init__(self, folder: str, rank: int) -> None:
        self._file = open(os.path.join(folder, "progress.bin"), "r+b")  # noqa: SIM115 - lives as long as the rank
        self._map = mmap.mmap(self._file.fileno(), 0)
        self._offset = rank * _SLOT_SIZE
        self._finished = 0
        self._entered = 0.0
        self._last_finished = read_slot(self._map, rank).last_finished_at

    @contextlib.contextmanager
    def inside(self, name: str) -> Iterator[None]:
        """The block counts as a collective called `name` (entered, then left, however it ends)."""
        self.enter(name)
        try:
            yield
        finally:
            self.leave(name)

    def enter(self, name: str) -> None:
        self._entered = time.monotonic()
        self._write_calls(1, name)

    def leave(self, name: str) -> None:
        self._finished += 1
        self._last_finished = time.monotonic()
        self._write_calls(0, name)

    def _write_calls(self, busy: int, name: str) -> None:
        calls = (self._finished, busy, self._entered, self._last_finished, name.encode()[:24])
        _CALLS.pack_into(self._map, self._offset, *calls)

    def record(self, status: RecorderStatus | None, changed_at: float, sampled_at: float, pending: str) -> None:
        """Written by the sampler thread only; `enter`/`leave` (main thread) write the other part."""
        issued, completed = (status.issued, status.completed) if status is not None else (-1, -1)
        _RECORDER.pack_into(
            self._map, self._offset + _CALLS.size, issued, completed, changed_at, sampled_at, pending.encode()[:40]
        )


# What torch's flight recorder says about this rank's collectives: how many issued, how many completed.
#
# Every c10d process group (gloo, and NCCL in CUDA builds) records each collective it is handed into torch's
# flight recorder, whoever issued it: `torch.distributed` calls from Python, DDP's gradient all-reduce in
# C++, functional collectives, FSDP, DeepSpeed. Each group also keeps the sequence number of its last
# enqueued and last completed collective, and NCCL's watchdog moves "completed" only when the work has
# finished on the card. So "issued more than completed" is the one test of "this rank waits for a
# collective" that holds for gloo and NCCL alike, including NCCL's return-on-enqueue.
#
# The recorder is on by default in current torch (`TORCH_FR_BUFFER_SIZE`, default 2000). Stall detection
# needs it: `require` refuses `stall_timeout=` where it is off or cannot see the run's backend, rather than
# watching nothing. `start_recorder_sampler` copies the counts into the rank's slot from a thread, because
# the main thread may be blocked in C++ (`.item()`, `synchronize()`, `wait()`), all of which release the
# GIL. It samples only when asked, so a run whose Python-level progress is visible anyway pays nothing.


@dataclasses.dataclass(frozen=True)
class RecorderStatus:
    """Collectives this rank issued and completed, summed over every process group torch recorded."""

    issued: int
    completed: int
    pending: tuple[tuple[str, int, int], ...]  # (recorder, process group id, first uncompleted sequence number)

    @property
    def waiting(self) -> bool:
        return self.issued > self.completed


def _dumpers() -> list[tuple[str, Callable[..., bytes]]]:
    """torch's recorder dump functions present in this build: NCCL's own (CUDA builds) and the generic one."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return []
    names = (("nccl", "_dump_nccl_trace"), ("generic", "_dump_fr_trace"))
    return [(label, getattr(c10d, name)) for label, name in names if getattr(c10d, name, None) is not None]


def _dump(dump: Callable[..., bytes], with_entries: bool) -> dict[str, Any]:
    try:
        raw = dump(with_entries, False, False)
    except TypeError:  # older builds take no arguments
        raw = dump()
    return dict(pickle.loads(raw))


# The first torch release whose flight recorder records gloo groups at all (2.3 to 2.7 record NCCL only);
# 2.8 to 2.10 record them only with TORCH_FR_BUFFER_SIZE set, 2.11 and later by default.
GLOO_RECORDED_SINCE = (2, 8)
DEFAULT_BUFFER_SINCE = (2, 11)
BUFFER_VAR = "TORCH_FR_BUFFER_SIZE"
_OFF_VARS = (BUFFER_VAR, "TORCH_NCCL_TRACE_BUFFER_SIZE")


def env_for_ranks() -> dict[str, str]:
    """What ranks with stall_timeout= get on top of the caller's environment: a recorder buffer (torch's own
    default size, 2000) where the user set none, since torch before 2.11 records gloo groups only then.
    An environment default for processes levers9 starts, read by torch when a group is made; nothing patched."""
    return {} if any(name in os.environ for name in _OFF_VARS) else {BUFFER_VAR: "2000"}


def _torch_version() -> tuple[int, ...]:
    import torch

    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2] if part.isdigit())


def forked_ranks_cannot_record(backend: str) -> bool:
    """True where ranks forked from this process might inherit a flight recorder without a buffer: torch before
    2.11 sizes it once per process, from TORCH_FR_BUFFER_SIZE (unset: none for gloo), when its first process
    group is made, and that may have happened in this process already (a group made and destroyed leaves no
    trace levers9 can read). Fresh interpreters read the variable anew."""
    return backend == "gloo" and _torch_version() < DEFAULT_BUFFER_SINCE and not os.environ.get(BUFFER_VAR)


def require(backend: str) -> None:
    """ConfigError unless torch's flight recorder can see this backend's collectives here (stall_timeout= needs it)."""
    import torch

    fix = "pass timeout= instead (it stops the run and reports where every rank was), or drop stall_timeout="
    off = next((name for name in _OFF_VARS if os.environ.get(name, "").strip() == "0"), None)
    if off is not None:
        raise ConfigError(
            f"stall_timeout= needs torch's flight recorder, which {off}=0 turns off. Expected it on (the default); "
            f"unset {off}, or {fix}."
        )
    version = _torch_version()
    names = [label for label, _ in _dumpers()]
    seen = ("generic" in names and version >= GLOO_RECORDED_SINCE) if backend == "gloo" else bool(names)
    if not seen:
        since = ".".join(map(str, GLOO_RECORDED_SINCE))
        raise ConfigError(
            f"stall_timeout= needs torch's flight recorder to record {backend} collectives, and torch "
            f"{torch.__version__} does not{' (gloo is recorded from torch ' + since + ' on)' if backend == 'gloo' else ''}. "
            f"Expected a torch that does; upgrade torch (pip install -U 'torch>={since}'), or {fix}."
        )


def _group_statuses() -> list[tuple[str, str, Any]]:
    """(recorder, process group id, its status) for every group each recorder knows, destroyed ones included."""
    found = []
    for label, dump in _dumpers():
        try:
            groups = _dump(dump, with_entries=False).get("pg_status", {})
        except Exception:  # a recorder that cannot dump is one we cannot read, not an error of the run
            continue
        found += [(label, str(group_id), status) for group_id, status in groups.items()]
    return found


def known_groups() -> frozenset[tuple[str, str]]:
    """The groups the recorders know now. A forked rank inherits the caller's (process group ids only
    grow), and their collectives are not the rank's own."""
    return frozenset((label, group_id) for label, group_id, _ in _group_statuses())


def read_status(inherited: frozenset[tuple[str, str]] = frozenset()) -> RecorderStatus | None:
    """This rank's counts now, leaving out the `inherited` groups, or None when torch records nothing
    (recorder off, too old, or no group yet)."""
    issued = completed = 0
    pending: list[tuple[str, int, int]] = []
    seen = False
    for label, group_id, status in _group_statuses():
        if (label, group_id) in inherited:
            continue
        try:
            last_issued = int(status["last_enqueued_collective"])
            last_completed = int(status["last_completed_collective"])
            group = int(group_id)
        except (KeyError, TypeError, ValueError):  # a layout this code does not know: leave the group out
            continue
        seen = True
        issued += max(last_issued, 0)
        completed += max(last_completed, 0)
        if last_issued > last_completed:
            pending.append((label, group, max(last_completed, 0) + 1))
    return RecorderStatus(issued, completed, tuple(pending)) if seen else None


def name_pending(status: RecorderStatus) -> str:
    """The first collective this rank issued and is still waiting for, e.g. "gloo:all_reduce #5"."""
    if not status.pending:
        return ""
    label, group_id, sequence = status.pending[0]
    dump = dict(_dumpers()).get(label)
    name = "collective"
    if dump is not None:
        try:
            entries = _dump(dump, with_entries=True).get("entries", [])
        except Exception:
            entries = []
        for entry in entries:
            if entry.get("pg_id") == group_id and entry.get("collective_seq_id") == sequence and not entry.get("is_p2p"):
                name = str(entry.get("profiling_name") or name)
                break
    return f"{name} #{sequence}"


# Fresh flight-recorder samples on request: a byte written to a rank's `sample-<rank>` FIFO asks its sampler
# thread to copy the recorder's counts into its slot. The parent asks once a second while no Python-level
# collective moves; reports ask before reading, so they never show stale counts.

Record = Callable[[RecorderStatus | None, float, float, str], None]  # writes a sample into a slot


def sample_fifo(folder: Path | str, rank: int) -> str:
    return os.path.join(folder, f"sample-{rank}")


def request_samples(folder: Path, ranks: Iterable[int]) -> None:
    """Ask each rank's sampler thread for a fresh recorder sample (a rank not listening yet is skipped)."""
    for rank in ranks:
        try:
            fd = os.open(sample_fifo(folder, rank), os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # ENXIO: nobody reads it yet; ENOENT: the run is over
            continue
        try:
            os.write(fd, b"s")
        except BlockingIOError:  # requests already queued: the next sample answers this one too
            pass
        finally:
            os.close(fd)


def fresh_states(
    folder: Path, ranks: list[int], read: Callable[[], list[SlotState]], rounds: int = 2, wait_s: float = 3.0
) -> list[SlotState]:
    """The board after `rounds` answered requests (two: a rank still waiting on the same counts gets named); each
    round waits up to `wait_s` for every rank's answer (a loaded machine can delay a rank's sampler thread)."""
    for _ in range(rounds):
        asked = time.monotonic()
        request_samples(folder, ranks)
        end = asked + wait_s
        while time.monotonic() < end and not all(read()[rank].recorder_sampled_at >= asked for rank in ranks):
            time.sleep(0.01)
    return list(read())


def start_recorder_sampler(record: Record, folder: str, rank: int) -> None:
    """Answer sample requests on this rank's FIFO from a daemon thread, for as long as the rank lives, each
    with `record(status, changed_at, sampled_at, pending)` (its slot's `RankSlot.record`).

    `changed_at` is the `time.monotonic()` at which the counts were first seen as they are now (a rank
    whose counts move is making progress); `sampled_at` says the request was answered. A rank seen
    waiting gets its pending collective named.
    """
    try:
        requests = os.open(sample_fifo(folder, rank), os.O_RDWR | os.O_CLOEXEC)  # O_RDWR: opening never blocks
    except OSError:  # the caller could not make the FIFO: stall detection uses the Python-level counts
        return
    inherited = known_groups()  # made before fn runs: every group the rank did not make itself

    def answer_requests() -> None:
        last: object = object()  # no status equals it: the first sample is a change
        changed_at, pending = 0.0, ""
        while True:  # a daemon: it ends with the rank
            os.read(requests, 64)  # blocks without the GIL; queued requests are answered by one sample
            status = read_status(inherited)
            now = time.monotonic()
            if status != last:
                last, changed_at, pending = status, now, ""
            if status is not None and status.waiting and not pending:
                pending = name_pending(status)
            record(status, changed_at, now, pending)

    threading.Thread(target=answer_requests, name="levers9-recorder-sampler", daemon=True).start()
