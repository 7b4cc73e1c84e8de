"""Every exception levers9 raises, in one place.

Each message says what was seen, what was expected, and the command or argument that fixes it.
Classes also derive from the builtin a caller would naturally catch (ValueError, TimeoutError, ...).

    Levers9Error
    ├── ConfigError (ValueError, TypeError) a bad argument to run / spawn / run_script / @job / the CLI; nothing started
    ├── LauncherEnvError (ValueError)       partial or contradictory RANK / WORLD_SIZE / ... environment
    ├── DeviceError (RuntimeError)          a local rank with no card to run on
    ├── NotShippableError (TypeError)       fn, cfg, an argument or a result cannot cross a process boundary
    ├── RankFailed (RuntimeError)           a rank of distributed.run failed; .failure says which and how
    │   ├── RankCrashed                     it exited with a code or died by a signal, no Python exception
    │   ├── RunTimeout (TimeoutError)       the run outlived timeout=
    │   ├── StallError                      ranks stopped making progress in a collective
    │   └── NodeLost                        a node of a multi-node run went silent (its agent died or froze)
    ├── QuirkError (RuntimeError)           this machine's cards / NCCL / shm cannot run the job as set up
    ├── PrivateDirError (PermissionError)   a folder levers9 keeps state in is another user's, a symlink, or open to others
    └── JobError                            the job layer (levers9.launch)
        ├── JobConfigError (ConfigError)    bad @job arguments or map cells; nothing was started
        ├── SettingsError (ValueError)      a corrupt or invalid workspace settings file
        ├── WorkspacePolicyError (PermissionError)   the per-job card cap or the multi-GPU switch
        ├── InfeasibleJobError (RuntimeError)   no worker could ever hold the cards this job asks for
        ├── JobCrashed (RuntimeError)       the job process died without a Python exception
        ├── JobTimeout (TimeoutError)       the job outlived its timeout=
        ├── RemoteError (RuntimeError)      the job raised an exception whose type cannot be rebuilt here
        └── RunFormatError (RuntimeError)   a run folder written by a newer levers9 (or not a run folder)

`distributed.spawn` raises two subclasses that are torch's types too (distributed/spawn_errors.py, which imports
torch): ProcessRaised (a RankFailed and torch's ProcessRaisedException) and ProcessExited (a RankCrashed and
torch's ProcessExitedException), so code written for mp.spawn catches them.
"""

from __future__ import annotations

import dataclasses
import enum
import signal as _signal
import warnings


class FailureKind(str, enum.Enum):
    """What went wrong with one rank or job process, one word each for both layers, decided from how it
    ended (levers9.procs.outcome.kind_of), never from a message. Every failure error has one as `.kind`;
    `restart_on=` and `retries=` name sets of them (levers9.retries). A `str`: `FailureKind.CRASH == "crash"`."""

    CRASH = "crash"  # killed by a signal (the out-of-memory killer included), or its card failed
    EXIT = "exit"  # left with a non-zero exit code of its own accord, raising nothing (sys.exit(3), os._exit(3))
    EXCEPTION = "exception"  # the function raised
    COMM = "comm"  # a collective or the rendezvous failed: a lost peer, a closed socket, a gloo/NCCL error
    LOST = "lost"  # its node (or the Ray task watching it) went away: how the process itself ended is unknown
    STALL = "stall"  # stopped: no rank issued or completed a collective for stall_timeout= seconds
    TIMEOUT = "timeout"  # stopped: it outlived timeout=
    QUEUE = "queue"  # never started: its cards were not free within queue_timeout=


class Levers9Error(Exception):
    """Base class of every levers9 error."""


class ConfigError(Levers9Error, ValueError, TypeError):
    """A bad argument (seen, expected, the fix); raised before anything starts. A ValueError and a
    TypeError both, since a caller checking arguments catches either."""


class LauncherEnvError(Levers9Error, ValueError):
    """The launcher environment is partial or contradictory (names the variables and values)."""


class DeviceError(Levers9Error, RuntimeError):
    """This rank has no card of its own (local rank beyond the visible cards)."""


class NotShippableError(Levers9Error, TypeError):
    """Something that must be pickled to reach another process cannot be."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessFailure:
    """What is known about one failed process: a rank (`RankFailure`) or a job's cell (`JobFailure`)."""

    pid: int
    exitcode: int | None = None
    signal: int | None = None
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    output_tail: str = ""
    oom_killed: bool = False  # killed by a signal while this cgroup's out-of-memory kill count rose
    kind: FailureKind | None = None  # decided from how the process ended (levers9.procs.outcome.kind_of)

    def who(self) -> str:
        """'rank 1' or 'cell #3': the process's name in reports."""
        raise NotImplementedError

    def how(self) -> str:
        """'raised ValueError', 'exited with code 3' or 'was killed by SIGKILL'."""
        if self.exc_type:
            return f"raised {self.exc_type}"
        if self.signal is not None:
            return f"was killed by {signal_name(self.signal)}"
        return f"exited with code {self.exitcode}"

    def describe(self) -> str:
        """A multi-line report: the headline, the traceback and the last output lines."""
        who = self.who()
        lines = [f"{who} (pid {self.pid}) {self.how()}" + (f": {self.message}" if self.message else "")]
        if self.traceback:
            lines += ["", f"Traceback from {who}:", self.traceback.rstrip()]
        if self.output_tail:
            lines += ["", f"Last output of {who}:", self.output_tail.rstrip()]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankFailure(ProcessFailure):
    """One failed rank of `distributed.run` (`RankFailed.failure`)."""

    rank: int

    def who(self) -> str:
        return f"rank {self.rank}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobFailure(ProcessFailure):
    """One failed job process: its cell of `.map` (0 for `.remote`) (`JobCrashed.failure`)."""

    cell: int

    def who(self) -> str:
        return f"cell #{self.cell}"

    @property
    def rank(self) -> int:
        """Deprecated spelling of `cell` (a job's failure was a RankFailure holding the cell's index as its rank)."""
        warnings.warn(
            "JobCrashed.failure.rank is deprecated: a job's failure is a JobFailure now; read .cell (the cell's index).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.cell


def signal_name(signum: int) -> str:
    """SIGKILL for 9, or 'signal 77' for a number with no name."""
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class RankFailed(Levers9Error, RuntimeError):
    """A rank failed; the first failure (the root cause) is `.failure`, the rest were stopped."""

    def __init__(self, message: str = "", failure: RankFailure | None = None) -> None:
        super().__init__(message)  # "" only where Python makes one bare (an exception set in another thread)
        self.failure = failure

    @property
    def kind(self) -> FailureKind | None:
        """The root cause's kind of failure (None: no rank's failure is known)."""
        return None if self.failure is None else self.failure.kind


class RankCrashed(RankFailed):
    """A rank exited non-zero or died by a signal without a Python exception to report."""


class RunTimeout(RankFailed, TimeoutError):
    """distributed.run outlived its timeout=; every rank was stopped."""

    kind = FailureKind.TIMEOUT


class StallError(RankFailed):
    """Ranks waited in a collective with no progress for longer than stall_timeout=."""

    kind = FailureKind.STALL


class NodeLost(RankFailed):
    """A node of a run across several Ray nodes stopped answering levers9's heartbeat, or never joined;
    `.node` is its address and `.ranks` the global ranks it held. A restart counts it as "comm"; when no
    node replaced it within queue_timeout its kind is "queue", which no restart cures."""

    kind = FailureKind.LOST

    def __init__(self, message: str, node: str = "", ranks: tuple[int, ...] = (), kind: FailureKind = FailureKind.LOST) -> None:
        super().__init__(message)
        self.node = node
        self.ranks = ranks
        self.kind = kind


class QuirkError(Levers9Error, RuntimeError):
    """A registered GPU/NCCL/platform quirk forbids this run as configured; the message names the fix."""


class PrivateDirError(Levers9Error, PermissionError):
    """A folder at a predictable path is not ours alone (owner, symlink or mode); names it and the fix."""


class JobError(Levers9Error):
    """Base class of the job layer's errors."""


class JobConfigError(JobError, ConfigError):
    """Bad @job arguments or map cells, found before anything started."""


class SettingsError(JobError, ValueError):
    """The workspace settings file is corrupt or holds an invalid value."""


class WorkspacePolicyError(JobError, PermissionError):
    """The job asks for more cards than the workspace allows (cap or multi-GPU switch)."""


class InfeasibleJobError(JobError, RuntimeError):
    """No worker could ever hold the cards this job asks for at once."""


class JobCrashed(JobError, RuntimeError):
    """The job process exited or died without a Python exception; names the code/signal and last output."""

    def __init__(self, message: str, failure: JobFailure | None = None, kind: FailureKind | str = FailureKind.CRASH) -> None:
        super().__init__(message)
        self.failure = failure
        self.kind = FailureKind(kind)  # CRASH (a signal), EXIT (an exit code of its own) or LOST (its Ray task)

    def __reduce__(self) -> tuple[type[JobCrashed], tuple[str, JobFailure | None, str]]:
        return type(self), (str(self), self.failure, self.kind.value)


class JobTimeout(JobError, TimeoutError):
    """The job outlived its timeout= (kind "timeout": its whole process tree was killed), or waited longer
    than queue_timeout= for its cards (kind "queue": it never started)."""

    def __init__(self, message: str, kind: FailureKind | str = FailureKind.TIMEOUT) -> None:
        super().__init__(message)
        self.kind = FailureKind(kind)

    def __reduce__(self) -> tuple[type[JobTimeout], tuple[str, str]]:
        return type(self), (str(self), self.kind.value)


class RunFormatError(JobError, RuntimeError):
    """A run folder this levers9 cannot read: a newer format, or no readable run.json."""


class RemoteError(JobError, RuntimeError):
    """A job or rank raised an exception whose type cannot be rebuilt in this process."""

    def __init__(self, exc_type: str, message: str, traceback: str = "") -> None:
        super().__init__(f"{exc_type}: {message}")
        self.exc_type = exc_type
        self.remote_message = message
        self.remote_traceback = traceback


def first_line(text: str, limit: int | None = None) -> str:
    """The first line of `text` (stripped; "" for none), cut to `limit` characters with "..." when longer."""
    stripped = text.strip()
    line = stripped.splitlines()[0] if stripped else ""
    return line if limit is None or len(line) <= limit else line[: limit - 3] + "..."


def add_note(exc: BaseException, note: str) -> None:
    """BaseException.add_note, also on Python 3.10."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*(getattr(exc, "__notes__", None) or []), note]
