"""What torch's flight recorder says about this rank's collectives: how many issued, how many completed.

Every c10d process group (gloo, and NCCL in CUDA builds) records each collective it is handed into
torch's flight recorder, whoever issued it: `torch.distributed` calls from Python, DDP's gradient
all-reduce in C++, functional collectives, FSDP, DeepSpeed. Each group also keeps the sequence number
of its last enqueued and last completed collective, and NCCL's watchdog moves "completed" only when the
work has finished on the card. So "issued more than completed" is the one test of "this rank waits for
a collective" that holds for gloo and NCCL alike, including NCCL's return-on-enqueue.

The recorder is on by default in current torch (`TORCH_FR_BUFFER_SIZE`, default 2000). Stall detection
needs it: `require` refuses `stall_timeout=` where it is off or cannot see the run's backend, rather
than watching nothing. `RecorderSampler` copies the counts into the rank's slot of the progress board
from a thread, because the main thread may be blocked in C++ (`.item()`, `synchronize()`, `wait()`),
all of which release the GIL. It samples only when asked, so a run whose Python-level progress is
visible anyway pays nothing for it.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

from levers9.errors import ConfigError


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
    found = []
    for label, name in (("nccl", "_dump_nccl_trace"), ("generic", "_dump_fr_trace")):
        dump = getattr(c10d, name, None)
        if dump is not None:
            found.append((label, dump))
    return found


def _dump(dump: Callable[..., bytes], with_entries: bool) -> dict[str, Any]:
    try:
        raw = dump(with_entries, False, False)
    except TypeError:  # older builds take no arguments
        raw = dump()
    return dict(pickle.loads(raw))


# The first torch release whose flight recorder records gloo groups at all (2.3 to 2.7 record NCCL only);
# 2.8 to 2.10 record them only with TORCH_FR_BUFFER_SIZE set, 2.11 and later by default.
GLOO_RECORDED_SINCE = (2, 8)
BUFFER_VAR = "TORCH_FR_BUFFER_SIZE"
_OFF_VARS = (BUFFER_VAR, "TORCH_NCCL_TRACE_BUFFER_SIZE")


def env_for_ranks() -> dict[str, str]:
    """What ranks with stall_timeout= get on top of the caller's environment: a recorder buffer (torch's own
    default size, 2000) where the user set none, since torch before 2.11 records gloo groups only then.
    An environment default for processes levers9 starts, read by torch when a group is made; nothing patched."""
    if any(name in os.environ for name in _OFF_VARS):
        return {}
    return {BUFFER_VAR: "2000"}


DEFAULT_BUFFER_SINCE = (2, 11)  # the first release that records gloo without TORCH_FR_BUFFER_SIZE set


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


class RecorderSampler(threading.Thread):
    """Each time `wait_for_request()` returns, writes `read_status()` with `write(status, changed_at, sampled_at, pending)`.

    `changed_at` is the `time.monotonic()` at which the counts were first seen as they are now (a rank
    whose counts move is making progress); `sampled_at` says the request was answered. A rank seen
    waiting gets its pending collective named.
    """

    def __init__(
        self,
        wait_for_request: Callable[[], None],
        write: Callable[[RecorderStatus | None, float, float, str], None],
    ) -> None:
        super().__init__(name="levers9-recorder-sampler", daemon=True)
        self._wait_for_request = wait_for_request
        self._write = write
        self._inherited = known_groups()  # made before fn runs: every group the rank did not make itself

    def run(self) -> None:
        last: RecorderStatus | None = None
        changed_at = 0.0
        pending = ""
        first = True
        while True:  # a daemon: it ends with the rank
            self._wait_for_request()
            status = read_status(self._inherited)
            now = time.monotonic()
            if first or status != last:
                first, last, changed_at, pending = False, status, now, ""
            if status is not None and status.waiting and not pending:
                pending = name_pending(status)
            self._write(status, changed_at, now, pending)
