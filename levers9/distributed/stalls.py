"""Seeing stalled ranks: which rank waits in which collective, and where every rank is.

Each run started by `distributed.run` gets a private run folder holding
- `progress.bin`: one slot per rank, read by the parent to notice a stall. Its first part is written
  by the rank whenever it enters or leaves a `torch.distributed` call from Python (how many it
  finished, whether it is in one now, which, and since when, on the machine-wide monotonic clock);
  its second part by a thread copying torch's flight recorder (collectives issued and completed,
  whoever issued them: see `flight_recorder`) each time it is asked;
- `sample-<rank>`: a FIFO; a byte written to it asks that rank's thread for a fresh recorder sample
  (the parent asks once a second while no Python-level collective moves; reports ask before reading);
- `stack-<rank>.txt`: where a rank's faulthandler writes every thread's Python stack when it gets
  SIGUSR1, so the parent (or `levers9 stacks <pid>` from another terminal) can say where it is;
- `ranks.json`: the caller's pid and the ranks' pids, for `levers9 stacks`.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import functools
import importlib.util
import json
import mmap
import os
import re
import shutil
import signal
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from levers9.distributed import flight_recorder
from levers9.private_dir import private_dir

STACK_SIGNAL = signal.SIGUSR1
_CALLS = struct.Struct("=QQdd24s")  # finished, in_collective, entered_at, last_finished_at, name
_RECORDER = struct.Struct("=qqdd40s")  # issued (-1: unknown), completed, changed_at, sampled_at, pending
_SLOT_SIZE = _CALLS.size + _RECORDER.size
# While no Python-level collective moved for this long, the parent asks for recorder samples this often.
QUIET_S = 1.0
RUN_DIR_PREFIX = "levers9-run-"
RANK_ENTRY = "rank_main"  # the function in _rank.py that calls the rank's fn: where its frames end

# The torch.distributed calls that block until every rank takes part (those a torch lacks are skipped).
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "send_object_list",
    "recv_object_list",
)


def runs_root() -> Path:
    """Where run folders live: our private levers9-<uid> folder in /dev/shm when it exists (memory, never a
    slow disk), else in the temp dir."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return private_dir(base / f"levers9-{os.getuid()}")


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


class RunFolder:
    """The parent's side: creates the folder and the progress board, reads them, removes them."""

    def __init__(self, nprocs: int) -> None:
        remove_stale_runs()
        self.path = Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-", dir=runs_root()))
        self.nprocs = nprocs
        board = self.path / "progress.bin"
        now = time.monotonic()
        with open(board, "wb") as f:
            for _ in range(nprocs):
                f.write(_CALLS.pack(0, 0, 0.0, now, b"") + _RECORDER.pack(-1, -1, now, 0.0, b""))
        for rank in range(nprocs):
            try:
                os.mkfifo(sample_fifo(self.path, rank), 0o600)
            except OSError:  # a filesystem without FIFOs: no recorder samples, the Python-level counts remain
                break
        self._file = open(board, "r+b")  # noqa: SIM115 - closed in remove()
        self._map = mmap.mmap(self._file.fileno(), _SLOT_SIZE * nprocs)
        self._last_request = 0.0

    def write_pids(self, parent: int, pids: list[int]) -> None:
        (self.path / "ranks.json").write_text(json.dumps({"parent": parent, "pids": pids}))

    def states(self) -> list[SlotState]:
        return [read_slot(self._map, rank) for rank in range(self.nprocs)]

    def sample_when_quiet(self, states: list[SlotState], now: float) -> None:
        """Ask every rank for a recorder sample, at most once per QUIET_S, while no Python-level call moved."""
        python_moved = max(max(s.entered_at, s.last_finished_at) for s in states)
        if now - python_moved >= QUIET_S and now - self._last_request >= QUIET_S:
            self._last_request = now
            request_samples(self.path, range(self.nprocs))

    def fresh_states(self, ranks: list[int]) -> list[SlotState]:
        return fresh_states(self.path, ranks, self.states)

    def remove(self) -> None:
        self._map.close()
        self._file.close()
        shutil.rmtree(self.path, ignore_errors=True)


def remove_stale_runs() -> None:
    """Remove run folders whose caller no longer exists (it was killed outright, so it could not)."""
    for folder in runs_root().glob(f"{RUN_DIR_PREFIX}*"):
        pid_text = folder.name[len(RUN_DIR_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:  # another user's live process
            continue


def read_slot(board: mmap.mmap, rank: int) -> SlotState:
    offset = rank * _SLOT_SIZE
    finished, busy, entered, last, name = _CALLS.unpack_from(board, offset)
    issued, completed, changed_at, sampled_at, pending = _RECORDER.unpack_from(board, offset + _CALLS.size)
    return SlotState(
        finished, bool(busy), entered, last, _text(name), issued, completed, changed_at, sampled_at, _text(pending)
    )


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
    folder: Path, ranks: list[int], read: Callable[[], list[SlotState]], rounds: int = 2, wait_s: float = 1.0
) -> list[SlotState]:
    """The board after `rounds` answered requests (two: a rank still waiting on the same counts gets named)."""
    for _ in range(rounds):
        asked = time.monotonic()
        request_samples(folder, ranks)
        end = asked + wait_s
        while time.monotonic() < end and not all(read()[rank].recorder_sampled_at >= asked for rank in ranks):
            time.sleep(0.01)
    return read()


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

    def enter(self, name: str) -> None:
        self._entered = time.monotonic()
        _CALLS.pack_into(self._map, self._offset, self._finished, 1, self._entered, self._last_finished, name.encode()[:24])

    def leave(self, name: str) -> None:
        self._finished += 1
        self._last_finished = time.monotonic()
        _CALLS.pack_into(self._map, self._offset, self._finished, 0, self._entered, self._last_finished, name.encode()[:24])

    def record(self, status: flight_recorder.RecorderStatus | None, changed_at: float, sampled_at: float, pending: str) -> None:
        """Written by the sampler thread only; `enter`/`leave` (main thread) write the other part."""
        issued, completed = (status.issued, status.completed) if status is not None else (-1, -1)
        _RECORDER.pack_into(
            self._map, self._offset + _CALLS.size, issued, completed, changed_at, sampled_at, pending.encode()[:40]
        )


def start_recorder_sampler(slot: RankSlot, folder: str, rank: int) -> None:
    """Answer sample requests on this rank's FIFO from a daemon thread for as long as the rank lives."""
    try:
        requests = os.open(sample_fifo(folder, rank), os.O_RDWR | os.O_CLOEXEC)  # O_RDWR: opening never blocks
    except OSError:  # the caller could not make the FIFO: stall detection uses the Python-level counts
        return

    def wait_for_request() -> None:
        os.read(requests, 64)  # blocks without the GIL; queued requests are answered by one sample

    flight_recorder.RecorderSampler(wait_for_request, slot.record).start()


def instrument_collectives(slot: RankSlot) -> None:
    """Wrap torch.distributed's blocking collectives so the slot knows when this rank is in one.

    DDP all-reduces gradients inside backward(), in C++, and waits for them before backward returns:
    once this process has built a DistributedDataParallel model, backward() counts as a collective
    too ("DDP backward"), so a rank stuck there is seen like one stuck in all_reduce.
    """
    import torch.autograd
    import torch.distributed as td
    from torch.nn.parallel import DistributedDataParallel

    for name in COLLECTIVES:
        original = getattr(td, name, None)
        if original is None or getattr(original, "__levers9_wrapped__", False):
            continue
        setattr(td, name, _tracked(original, name, slot))

    if getattr(torch.autograd.backward, "__levers9_wrapped__", False):
        return
    ddp_built = [False]
    original_init = DistributedDataParallel.__init__

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        ddp_built[0] = True

    DistributedDataParallel.__init__ = init  # type: ignore[method-assign]
    original_backward = torch.autograd.backward
    tracked_backward = _tracked(original_backward, "DDP backward", slot)

    @functools.wraps(original_backward)
    def backward(*args: Any, **kwargs: Any) -> Any:
        return (tracked_backward if ddp_built[0] else original_backward)(*args, **kwargs)

    backward.__levers9_wrapped__ = True  # type: ignore[attr-defined]
    torch.autograd.backward = backward  # Tensor.backward looks it up here at every call


def _tracked(original: Callable[..., Any], name: str, slot: RankSlot) -> Callable[..., Any]:
    @functools.wraps(original)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        slot.enter(name)  # async calls (and NCCL's, which return once enqueued) count as issued too
        try:
            return original(*args, **kwargs)
        finally:
            slot.leave(name)

    tracked.__levers9_wrapped__ = True  # type: ignore[attr-defined]
    return tracked


def enable_stack_dumps(folder: str, rank: int) -> None:
    """Have this rank write every thread's Python stack to its stack file on SIGUSR1."""
    handle = open(os.path.join(folder, f"stack-{rank}.txt"), "w")  # noqa: SIM115 - faulthandler keeps it
    faulthandler.register(STACK_SIGNAL, file=handle, all_threads=True, chain=False)
    global _stack_handle
    _stack_handle = handle


_stack_handle: Any = None


@dataclasses.dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Where levers9 and torch are installed, found without importing torch (`levers9 stacks` stays quick)."""
    dirs = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        dirs.extend(spec.submodule_search_locations)
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


def _is_library(file: str) -> bool:
    """A frame of levers9, torch or the threading module, or a pseudo-file such as "<frozen runpy>".

    Decided by where those packages really are, never by a name in the path: a project checked out
    as ~/levers9 or ~/torch/ is the user's code.
    """
    if file.startswith("<"):
        return True
    real = os.path.realpath(file)
    return real == os.path.realpath(threading.__file__) or real.startswith(_library_dirs())


def main_thread_frames(dump: str) -> list[Frame]:
    """The frames (most recent first) of the thread in a faulthandler dump that runs the rank's fn."""
    threads = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip())
    parsed = [[Frame(m["file"], int(m["line"]), m["func"]) for m in map(_FRAME.match, t.splitlines()) if m] for t in threads]
    for frames in parsed:
        entry = next((i for i, f in enumerate(frames) if f.function == RANK_ENTRY), None)
        if entry is not None:
            return frames[:entry]  # what the rank's fn called, not how levers9 got there
    return parsed[0] if parsed else []


def user_frame(frames: list[Frame]) -> Frame | None:
    """The most recent frame outside torch and levers9: where the user's code is."""
    return next((f for f in frames if not _is_library(f.file)), frames[0] if frames else None)


def collect_stacks(pids: dict[int, int], folder: Path, wait_s: float = 3.0) -> dict[int, str]:
    """Ask each rank (rank -> pid) for its stacks with SIGUSR1; return the new text of each stack file.

    faulthandler writes thread by thread, newest thread first, so the thread running the rank's fn
    comes last: a dump counts once it holds that thread's entry frame (`RANK_ENTRY`). A rank that has
    not got that far by `wait_s` gives what it wrote; one that wrote nothing is left out.
    """
    start: dict[int, int] = {}
    for rank, pid in pids.items():
        path = folder / f"stack-{rank}.txt"
        start[rank] = path.stat().st_size if path.exists() else 0
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            continue
    dumps: dict[int, str] = {}
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        time.sleep(0.02)
        for rank in pids:
            dumps[rank] = _text_since(folder / f"stack-{rank}.txt", start[rank])
        if all(f" in {RANK_ENTRY}\n" in text for text in dumps.values()):
            break
    return {rank: text for rank, text in dumps.items() if text}


def _text_since(path: Path, offset: int) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""


def describe_ranks(states: list[SlotState], dumps: dict[int, str], now: float) -> str:
    """One line per rank (waiting in which collective for how long, or where it is), then every rank's stack."""
    lines = []
    for rank, state in enumerate(states):
        where = user_frame(main_thread_frames(dumps.get(rank, "")))
        at = f" at {where}" if where else " (no stack: the rank did not answer)"
        counts = _counts(state)
        if state.in_collective:
            lines.append(f"  rank {rank}: waiting in {state.name} for {now - state.entered_at:.1f} s ({counts}){at}")
        elif state.waiting_for_issued:
            collective = state.pending or "a collective it issued"
            lines.append(
                f"  rank {rank}: waiting for {collective} to complete, for {now - state.recorder_changed_at:.1f} s "
                f"({counts}){at}"
            )
        else:
            lines.append(f"  rank {rank}: not in a collective ({counts}){at}")
    stacks = []
    for rank in range(len(states)):
        frames = main_thread_frames(dumps.get(rank, ""))
        if frames:
            stacks.append(f"Rank {rank} (most recent call first):\n" + "\n".join(f"  {f}" for f in frames))
    return "\n".join(lines) + ("\n\n" + "\n\n".join(stacks) if stacks else "")


def _counts(state: SlotState) -> str:
    """The recorder's counts when it is on (they include collectives issued from C++), else the Python calls'."""
    last = f"; last call {state.name}" if state.name else ""
    if state.recorder_known:
        return f"{state.recorder_issued} collective(s) issued, {state.recorder_completed} completed{last}"
    return f"{state.finished + state.in_collective} collective(s) issued{last}"


def stalled(states: list[SlotState], stall_timeout: float, now: float) -> bool:
    """True when nothing moved for `stall_timeout` seconds while at least one rank waits for a collective.

    Waiting: inside a blocking `torch.distributed` call (gloo, barriers), or, by torch's flight recorder,
    holding a collective it issued that has not completed (NCCL returns once a collective is enqueued,
    so the rank ahead waits further on, e.g. in `.item()`). With the recorder off, ranks that issued
    different numbers of collectives from Python stand in for the second test.
    """
    last_move = max(max(s.entered_at, s.last_finished_at, s.recorder_changed_at) for s in states)
    if now - last_move < stall_timeout:
        return False
    if any(s.in_collective or s.waiting_for_issued for s in states):
        return True
    if any(s.recorder_known for s in states):  # it is on: a rank it has not seen has issued nothing
        return False
    return len({s.finished for s in states}) > 1


def find_run(pid: int) -> Path | None:
    """The run folder of the run whose caller or one of whose ranks has `pid`."""
    root = runs_root()
    for folder in sorted(root.glob(f"{RUN_DIR_PREFIX}*")):
        info = folder / "ranks.json"
        try:
            data = json.loads(info.read_text())
        except (OSError, ValueError):
            continue
        if pid == data.get("parent") or pid in data.get("pids", []):
            return folder
    return None


def live_runs() -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every run folder whose caller is still alive, with its ranks.json."""
    for folder in sorted(runs_root().glob(f"{RUN_DIR_PREFIX}*")):
        try:
            data = json.loads((folder / "ranks.json").read_text())
            os.kill(int(data["parent"]), 0)
        except (OSError, ValueError, KeyError):
            continue
        yield folder, data


def report_for_run(folder: Path) -> str:
    """The stall-style report for a live run, taken on demand without stopping it."""
    data = json.loads((folder / "ranks.json").read_text())
    pids = {rank: pid for rank, pid in enumerate(data["pids"])}
    with open(folder / "progress.bin", "rb") as f:
        board = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            states = fresh_states(folder, list(pids), lambda: [read_slot(board, rank) for rank in pids])
        finally:
            board.close()
    dumps = collect_stacks(pids, folder)
    return f"levers9 run of pid {data['parent']} ({len(pids)} ranks):\n" + describe_ranks(states, dumps, time.monotonic())
