"""Where each rank is: stack dumps on a signal, the frames they hold, and the stall rule and report text.

Each rank's faulthandler writes every thread's Python stack to `stack-<rank>.txt` in the board folder
when it gets SIGUSR1, so the parent (or `levers9 stacks <pid>` from another terminal) can say where it
is. `stalled` decides from the progress board when a run is stuck; `describe_ranks` says how.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import functools
import importlib.util
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

from levers9.distributed.stalls.board import SlotState

STACK_SIGNAL = signal.SIGUSR1
RANK_ENTRY = "rank_main"  # the function that calls the rank's fn in each rank: where its frames end


# Process-wide, as the OS signal disposition is: the file faulthandler writes SIGUSR1 stack dumps to.
_stack_handle: Any = None


def enable_stack_dumps(folder: str, rank: int) -> None:
    """Have this rank write every thread's Python stack to its stack file on SIGUSR1."""
    global _stack_handle
    path = os.path.join(folder, f"stack-{rank}.txt")
    _stack_handle = open(path, "w")  # noqa: SIM115 - faulthandler keeps it
    faulthandler.register(STACK_SIGNAL, file=_stack_handle, all_threads=True, chain=False)


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
    dirs = [str(Path(__file__).resolve().parents[2])]  # levers9/, from levers9/distributed/stalls/report.py
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        dirs.extend(spec.submodule_search_locations)
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


def _is_library(file: str) -> bool:
    """A frame of levers9, torch or the threading module, or a pseudo-file such as "<frozen runpy>".

    Decided by where those packages really are, never by a name in the path: a project checked out
    as ~/levers9 or ~/torch/ is the user's code.
    """
    if file.startswith("<"):  # "<frozen runpy>" is the library's; "<dynamic-code>" is a function shipped by value
        return not file.startswith("<dynamic-code")
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
    # faulthandler stops at 100 frames, so a deep stack (an import chain) can hide the entry frame: the
    # thread that runs fn is then the oldest one, which faulthandler writes last.
    return parsed[-1] if parsed else []


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
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STACK_SIGNAL)
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


def describe_ranks(
    states: list[SlotState], dumps: dict[int, str], now: float, names: list[str] | None = None,
    stopped: set[int] | frozenset[int] = frozenset(),
) -> str:  # fmt: skip
    """One line per rank (stopped, waiting in which collective for how long, or where it is), then every rank's
    stack; `names` says what to call each slot's rank (default 'rank <slot>'); `stopped`: slots whose rank is
    stopped (SIGSTOP, a debugger)."""
    names = names or [f"rank {slot}" for slot in range(len(states))]
    lines, stacks = [], []
    for rank, state in enumerate(states):
        name, frames = names[rank], main_thread_frames(dumps.get(rank, ""))
        where = user_frame(frames)
        at = f" at {where}" if where else " (no stack: the rank did not answer)"
        counts = _counts(state)
        if rank in stopped:
            lines.append(
                f"  {name}: stopped (SIGSTOP, job control or a debugger: state T in /proc), so it runs no "
                f"collective: {_stopped_counts(state, states)}. Continue it with `kill -CONT <pid>`, or find what "
                f"stopped it"
            )
        elif state.in_collective:
            seconds = now - state.entered_at
            lines.append(f"  {name}: waiting in {state.name} for {seconds:.1f} s ({counts}){at}")
        elif state.waiting_for_issued:
            what = state.pending or "a collective it issued"
            seconds = now - state.recorder_changed_at
            lines.append(f"  {name}: waiting for {what} to complete, for {seconds:.1f} s ({counts}){at}")
        else:
            lines.append(f"  {name}: not in a collective ({counts}){at}")
        if frames:
            frame_lines = "\n".join(f"  {f}" for f in frames)
            stacks.append(f"{name[0].upper()}{name[1:]} (most recent call first):\n{frame_lines}")
    return "\n".join(lines) + ("\n\n" + "\n\n".join(stacks) if stacks else "")


def _stopped_counts(state: SlotState, states: list[SlotState]) -> str:
    """How far a stopped rank got. It answers no sample, so where its own recorder was never read, from the
    others': a collective of the whole group completes only once every rank took part in it."""
    if state.recorder_known:
        return _counts(state)
    peers = [s.recorder_completed for s in states if s.recorder_known]
    awaited = next((s.pending for s in states if s.pending and s.waiting_for_issued), "")
    done = f"it completed {min(peers)} collective(s) with the other ranks" if peers else _counts(state)
    return done + (f", and has not joined {awaited}, which they wait for" if awaited else "")


def _counts(state: SlotState) -> str:
    """The flight recorder's counts (every collective, whoever issued it), or that it recorded none yet."""
    if state.recorder_known:
        return f"{state.recorder_issued} collective(s) issued, {state.recorder_completed} completed"
    return "no collective recorded yet"


@dataclasses.dataclass(frozen=True)
class Quiet:
    """How long a board's ranks have not issued or completed a collective, and whether one of them waits for one."""

    seconds: float
    waiting: bool


def quiet_of(states: list[SlotState], now: float) -> Quiet:
    """These ranks' Quiet at `now`: since any entered or left a collective or its recorder's counts changed,
    and whether one is inside a collective or holds one it issued that has not completed."""
    moved = max(max(s.entered_at, s.last_finished_at, s.recorder_changed_at) for s in states)
    return Quiet(now - moved, any(s.in_collective or s.waiting_for_issued for s in states))


def stall_of(quiets: list[Quiet], stall_timeout: float) -> bool:
    """A stall: every board (one per node) quiet for `stall_timeout` s, and a rank on one of them waiting."""
    return min(q.seconds for q in quiets) >= stall_timeout and any(q.waiting for q in quiets)


def stalled(states: list[SlotState], stall_timeout: float, now: float) -> bool:
    """True when nothing moved for `stall_timeout` seconds while at least one rank waits for a collective.

    Waiting: by torch's flight recorder, holding a collective it issued that has not completed (gloo's
    blocking calls and NCCL's enqueued work alike, so the rank ahead may wait further on, e.g. in
    `.item()`), or inside levers9's own wait for the group to form.
    """
    return stall_of([quiet_of(states, now)], stall_timeout)


def stall_text(stall_timeout: float) -> str:
    """The headline of a StallError: what was seen, the usual cause, the fix."""
    return (
        f"distributed.run stalled: for {stall_timeout:g} s (stall_timeout={stall_timeout:g}) no "
        f"rank issued or completed a collective while at least one waited for one; every rank was stopped. "
        f"The rank that is not waiting, or issued fewer collectives, is usually the cause: a skipped "
        f"collective, uneven data, or a loader that hangs. Pass a larger stall_timeout= if a step "
        f"legitimately takes longer."
    )
