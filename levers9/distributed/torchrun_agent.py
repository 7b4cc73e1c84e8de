"""What torchrun's agent gives a worker beyond its variables, for `levers9 run`: its log files, error files, role and
console prefixes, its MASTER_PORT, its virtual local rank.

The folders are torch's own: each attempt asks the run's `LogsSpecs` (torch's `DefaultLogsSpecs`, or the one
`--logs-specs` names) where each local rank's output and error file go, exactly as torchrun's agent asks it
(`DIR/<run id>_<random>/attempt_<n>/<local rank>/{stdout,stderr}.log` and `error.json`, the streams only where
`--redirects`/`--tee` name them), and that call sets `TORCHELASTIC_ERROR_FILE` in each rank's variables, so
`@record` writes its error file where torchrun's would be. Output still reaches levers9 through its pipes, not by
tailing files: `AttemptOutput` writes each piece to the rank's file, to the console where it is teed (after
torchrun's `[<role><local rank>]:` header, or TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE's), to the filtered copy
where `--duplicate-std*-filters` match, and nowhere else where it is redirected. A stream that is neither goes to
the console as levers9 writes it (`[rank N] ` before ranks but 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import string
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from levers9.distributed.rank_set import PieceSink
from levers9.procs import echo
from levers9.procs.echo import LabelledOutput
from levers9.procs.watch import TERMINATING_SIGNALS, ExitOnFirstSignal, exit_on_terminate

CONSOLE = ""  # torch's LogsDest: this stream goes to the console
FILTER_LINE_CHARS = 1 << 20  # a longer line is matched against --duplicate-std*-filters on its start


@dataclasses.dataclass
class TorchrunAgent:
    """The run's torchrun settings that reach each attempt's ranks (levers9 run's, once per run)."""

    logs: Any  # a torch LogsSpecs: where each attempt's files go
    role: str = "default"
    prefix_template: str | None = None  # TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: ${role_name}, ${rank}, ${local_rank}
    stdout_filters: tuple[str, ...] = ()
    stderr_filters: tuple[str, ...] = ()
    virtual_local_rank: bool = False
    master_port: int | None = None  # MASTER_PORT when it is free (--master-port)
    run_id: str | None = None  # TORCHELASTIC_RUN_ID, the same in every attempt, as torchrun keeps it
    made_root: str | None = None  # a temporary root this run made for error files (no --log-dir): removed at the end
    error_files: dict[int, str] = dataclasses.field(default_factory=dict)  # the latest attempt's, by local rank

    def attempt(self, envs: dict[int, dict[str, str]], console: PieceSink) -> AttemptOutput:
        """The files of the attempt whose ranks get `envs` (local rank -> its variables; TORCHELASTIC_ERROR_FILE,
        ROLE_NAME and the virtual local rank are set in them here), and the sink its ranks' output goes to."""
        for local, env in envs.items():
            env["ROLE_NAME"] = self.role
            if self.virtual_local_rank:
                env.update(virtual_local_rank_env(local, os.environ.get("CUDA_VISIBLE_DEVICES")))
        dest = self.logs.reify(envs)
        self.error_files = dict(dest.error_files)
        headers = {local: self._header(local, int(env["RANK"])) for local, env in envs.items()}
        return AttemptOutput(dest, headers, console, self.stdout_filters, self.stderr_filters)

    def _header(self, local: int, rank: int) -> str:
        if self.prefix_template:
            return string.Template(self.prefix_template).safe_substitute(role_name=self.role, rank=rank, local_rank=local)
        return f"[{self.role}{local}]:"

    def error_report(self, local_rank: int) -> tuple[str, str] | None:
        """What the rank's error file (written by torch's `@record`) says, as torchrun's summary shows it: the line
        naming the file ("" when it is in the temporary folder removed at the end) and its traceback (or message);
        None when the rank wrote none."""
        path = self.error_files.get(local_rank)
        if not path or not os.path.isfile(path):
            return None
        try:
            with open(path) as f:
                message = json.load(f).get("message", {})
        except (OSError, ValueError):
            return None
        where = "" if self.made_root is not None else f"error_file: {path}"
        if isinstance(message, str):
            return where, message.rstrip()
        stack = message.get("extraInfo", {}).get("py_callstack", "")
        return where, str(stack or message.get("message", "")).rstrip()

    def close(self) -> None:
        """Remove the temporary root made for error files (none with --log-dir: that one stays, as torchrun's does)."""
        if self.made_root is not None:
            shutil.rmtree(self.made_root, ignore_errors=True)


def virtual_local_rank_env(local_rank: int, visible: str | None) -> dict[str, str]:
    """torchrun's --virtual-local-rank: LOCAL_RANK 0, and only the rank's own card visible (through the caller's
    CUDA_VISIBLE_DEVICES where it set one)."""
    cards = [card.strip() for card in visible.split(",")] if visible is not None else None
    if cards is not None and local_rank >= len(cards):
        raise ValueError(f"local rank {local_rank} has no card in CUDA_VISIBLE_DEVICES={visible}")
    return {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": str(local_rank) if cards is None else cards[local_rank]}


def split_filters(text: str | None) -> tuple[str, ...]:
    """torchrun's --duplicate-std*-filters value as needles: split at commas, a doubled comma is a comma."""
    if not text:
        return ()
    return tuple(part.replace("\0", ",") for part in text.replace(",,", "\0").split(",") if part)


class AttemptOutput:
    """One attempt's output pieces, each to where torch's LogsDest sends its rank's stream (see the module's doc)."""

    def __init__(self, dest: Any, headers: Mapping[int, str], console: PieceSink, stdout_filters: tuple[str, ...],
                 stderr_filters: tuple[str, ...]) -> None:  # fmt: skip
        self.dest, self.headers, self.console = dest, headers, console
        self.filters = {"stdout": stdout_filters, "stderr": stderr_filters}
        self.teed = LabelledOutput(echo.write)
        self._files: dict[str, TextIO] = {}
        self._partial: dict[tuple[int, str], str] = {}  # a teed stream's line so far, for the filters
        self._decided: dict[tuple[int, str], bool] = {}  # a long line decided on its start: copied or not
        for path in [*dest.stdouts.values(), *dest.stderrs.values()]:  # made before any rank starts, as torchrun's are
            if path not in (CONSOLE, os.devnull):
                self._file(path)
        for needles, path in ((stdout_filters, dest.filtered_stdout), (stderr_filters, dest.filtered_stderr)):
            if needles:
                self._file(path)

    def __call__(self, rank: int, stream: str, text: str) -> None:
        path = (self.dest.stdouts if stream == "stdout" else self.dest.stderrs).get(rank, CONSOLE)
        if path == CONSOLE:
            self.console(rank, stream, text)
            return
        if path == os.devnull:
            return
        self._file(path).write(text)
        if rank in (self.dest.tee_stdouts if stream == "stdout" else self.dest.tee_stderrs):
            self.teed(rank, self.headers[rank], stream, text)
            self._filter(rank, stream, text)

    def _filter(self, rank: int, stream: str, text: str) -> None:
        """Copy a teed line holding one of the stream's needles to its filtered file; a line is decided on its
        first FILTER_LINE_CHARS (so no line is held whole), and the rest of it follows that decision."""
        needles = self.filters[stream]
        if not needles:
            return
        key = (rank, stream)
        decided = self._decided.get(key)
        if decided is not None:  # the rest of a long line
            if decided:
                self._file(self._filtered(stream)).write(text)
            if text.endswith("\n"):
                del self._decided[key]
            return
        line = self._partial.pop(key, "") + text
        if not line.endswith("\n") and len(line) < FILTER_LINE_CHARS:
            self._partial[key] = line
            return
        matched = any(needle in line for needle in needles)
        if matched:
            self._file(self._filtered(stream)).write(self.headers[rank] + line)
        if not line.endswith("\n"):
            self._decided[key] = matched

    def _filtered(self, stream: str) -> str:
        return str(self.dest.filtered_stdout if stream == "stdout" else self.dest.filtered_stderr)

    def _file(self, path: str) -> TextIO:
        if path not in self._files:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            self._files[path] = open(fd, "w", buffering=1, errors="replace")  # noqa: SIM115 - closed in close()
        return self._files[path]

    def close(self) -> None:
        for f in self._files.values():
            with contextlib.suppress(OSError):
                f.close()
        self._files.clear()


def logs_specs(name: str | None, log_dir: str | None, redirects: str, tee: str, console_ranks: set[int] | None) -> Any:
    """The run's LogsSpecs, as torchrun makes it: the class `--logs-specs` names in the `torchrun.logs_specs` entry
    points (torch's DefaultLogsSpecs without it), given the log folder, redirects, tee and console filter."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std

    cls: type[Any] = DefaultLogsSpecs
    if name is not None:  # torchrun's own look-up (0.3 s of imports, so only when asked)
        from torch.distributed.run import _get_logs_specs_class

        cls = _get_logs_specs_class(name)
    return cls(log_dir=log_dir, redirects=Std.from_str(redirects), tee=Std.from_str(tee), local_ranks_filter=console_ranks)


def root_made_for(specs: Any, log_dir: str | None) -> str | None:
    """The temporary root torch made for `specs` when no log folder was given (to remove at the end), else None."""
    root = getattr(specs, "root_log_dir", None)
    return None if log_dir or root is None or not Path(root).name.startswith("torchelastic_") else str(root)


@contextlib.contextmanager
def stops_on(signals: tuple[signal.Signals, ...]) -> Iterator[None]:
    """While the ranks run (--signals-to-handle): each of `signals` that would otherwise kill or stop levers9 run
    (SIGQUIT, SIGUSR1, ...) raises SystemExit(128 + signal), so every rank is stopped with its grace and levers9 run
    ends, as for SIGTERM (procs.watch.exit_on_terminate, which always covers SIGTERM and SIGHUP; Ctrl-C always stops
    them too). A handler the caller installed stays; handlers are put back afterwards, and a forked rank puts the
    default back before the script starts (`default_handlers_in_rank`)."""
    with exit_on_terminate(tuple(s for s in signals if s is not signal.SIGINT and s not in TERMINATING_SIGNALS)):
        yield


def default_handlers_in_rank() -> None:
    """In a rank forked while `stops_on` held: the signals it caught back to their default, as a fresh process has
    them (the script's own signal.signal calls come after)."""
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if isinstance(signal.getsignal(signum), ExitOnFirstSignal):
                signal.signal(signum, signal.SIG_DFL)
