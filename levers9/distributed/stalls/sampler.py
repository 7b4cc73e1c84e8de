"""Fresh flight-recorder samples on request: a FIFO per rank, and the rank's thread that answers it.

A byte written to a rank's `sample-<rank>` FIFO asks that rank's sampler thread to copy torch's
flight-recorder counts into its slot of the progress board. The parent asks once a second while no
Python-level collective moves; reports ask before reading, so they never show stale counts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from levers9.distributed.stalls import flight_recorder


class _Sampled(Protocol):
    @property
    def recorder_sampled_at(self) -> float: ...


State = TypeVar("State", bound=_Sampled)  # a slot's state as the progress board reads it
Record = Callable[[flight_recorder.RecorderStatus | None, float, float, str], None]  # writes a sample into a slot


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
    folder: Path, ranks: list[int], read: Callable[[], Sequence[State]], rounds: int = 2, wait_s: float = 3.0
) -> list[State]:
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
    """Answer sample requests on this rank's FIFO from a daemon thread, writing each sample with `record`
    (its slot's `RankSlot.record`), for as long as the rank lives."""
    try:
        requests = os.open(sample_fifo(folder, rank), os.O_RDWR | os.O_CLOEXEC)  # O_RDWR: opening never blocks
    except OSError:  # the caller could not make the FIFO: stall detection uses the Python-level counts
        return

    def wait_for_request() -> None:
        os.read(requests, 64)  # blocks without the GIL; queued requests are answered by one sample

    flight_recorder.RecorderSampler(wait_for_request, record).start()
