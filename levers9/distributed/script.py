"""`distributed.run_script`: run an existing script, module or program on every rank, as torchrun would.

Each rank runs the target as `__main__` with `sys.argv` set and torchrun's worker variables in its
environment, so a script written for torchrun (it calls `init_process_group` itself) runs unchanged.
The ranks are `distributed.run`'s, so they start fast and a failure comes back with the rank, its
traceback and its exit code. `exit_code_for` maps a failure to the exit status torchrun would give.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import importlib.machinery
import importlib.util
import io
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import types
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from levers9.console_log import fresh_logging
from levers9.distributed import detect, devices
from levers9.distributed.control_store import hosted_store
from levers9.distributed.devices import plan_layout, visible_card_count
from levers9.distributed.rank_set import rank_vars
from levers9.distributed.restarts import rank_failed_behind
from levers9.distributed.running import RunOptions, run_with
from levers9.distributed.started_ranks import one_thread_each
from levers9.distributed.torchrun_agent import default_handlers_in_rank
from levers9.errors import ConfigError, FailureKind, RankCrashed, RankFailure
from levers9.procs.failure import exit_status
from levers9.runtime import current_job

NPROC_WORDS = ("gpu", "cpu", "auto")
_LIBRARY_FILES = (str(Path(__file__).resolve().parent.parent), runpy.__file__, "<frozen runpy>")


@dataclasses.dataclass(frozen=True)
class ScriptTarget:
    """What every rank runs, and how: shipped to the ranks as distributed.run's cfg."""

    kind: str  # "path" (a .py file, or a folder or zip with __main__.py), "module" (-m), "program" (--no-python) or
    # "run_path" (torchrun's --run-path: runpy.run_path)
    name: str  # absolute path, module name or program
    typed: str = ""  # the path as given, for sys.argv[0] (as `python path` keeps it)
    argv: tuple[str, ...] = ()
    log_dir: str | None = None  # a copy of each rank's output goes to LOG_DIR/<local rank>/{stdout,stderr}.log
    console_ranks: tuple[int, ...] | None = None  # local ranks whose output reaches the console (None: all)


def run_script(
    target: str,
    argv: Sequence[str] = (),
    *,
    module: bool = False,
    no_python: bool = False,
    nprocs: int | str | None = None,
    backend: str | None = None,
    timeout: float | None = None,
    stall_timeout: float | None = None,
    start_method: str | None = None,
    prefix_output: bool = True,
    log_dir: str | None = None,
    console_ranks: Sequence[int] | None = None,
    max_restarts: int | None = None,
    restart_on: Sequence[str] | None = None,
    restart_delay: float | None = None,
) -> None:
    """Run a script, module or program on every rank, each as `__main__` under torchrun's environment.

    The ranks are `distributed.run`'s, with no process group: the script makes its own with
    torch's env:// (as under torchrun). Returns when every rank is done; a rank that exits 0 early
    is not a failure. The Python form of `levers9 run`.

    Args:
        target: A script path (a .py file, or a folder or zip with `__main__.py`), a module name
            (`module=True`) or a program (`no_python=True`).
        argv: The arguments every rank sees in `sys.argv[1:]`.
        module: Run `target` as a module, as `python -m` does.
        no_python: Run `target` as a program, not through Python (torchrun's `--no-python`).
        nprocs: A number of ranks, "gpu" (one per card), "cpu" (one per CPU core), "auto" (cards if
            any, else CPU cores) or None (one per visible card, else one).
        backend: "nccl" or "gloo" for the ranks' default; None: nccl on cards, else gloo.
        timeout: Seconds; as in `distributed.run`.
        stall_timeout: Seconds; as in `distributed.run`.
        start_method: "fork" or "spawn"; as in `distributed.run`.
        prefix_output: Put "[rank N] " before lines from ranks other than 0 (default on).
        log_dir: A folder in which a fresh private folder (0700) is made for this run, holding a copy
            of each rank's output in `<rank>/stdout.log` and `stderr.log` (0600).
        console_ranks: Local ranks whose output reaches the console (None: all); a failure report
            still does.
        max_restarts: As in `distributed.run`.
        restart_on: As in `distributed.run`.
        restart_delay: As in `distributed.run`.

    Raises:
        ConfigError: A bad argument, before anything starts (also when called inside a rank).
        RankFailed: A rank raised, exited non-zero or died, as `distributed.run` raises it (the
            other ranks are stopped).
    """
    script = prepare(target, argv, module=module, no_python=no_python, log_dir=log_dir, console_ranks=console_ranks)
    count, backend = resolve_nprocs(nprocs, backend)
    script = with_log_folder(script)
    say_one_thread_each(count)
    options = RunOptions(nprocs=count, backend=backend, timeout=timeout, stall_timeout=stall_timeout,
                         start_method=start_method, prefix_output=prefix_output, max_restarts=max_restarts,
                         restart_on=restart_on, restart_delay=restart_delay,
                         init_group=False)  # the script makes its own group, as under torchrun  # fmt: skip
    run_with(run_script_target, script, options)


def refuse_inside_a_rank(what: str) -> None:
    """ConfigError when this process is already a rank of torchrun, srun, mpirun or levers9."""
    info = detect.launch_info()
    if info.launcher == "single" and detect.live_group() is None:
        return
    raise ConfigError(
        f"{what} was started inside rank {info.rank} of {info.world_size} (launcher: {info.launcher}), but it starts "
        f"ranks itself: each rank would start {what.split()[0]} ranks of its own. Expected to be started once, "
        f"outside any launcher; run it from a plain shell (`levers9 run --nproc-per-node N train.py`), or keep the "
        f"launcher and run the script directly under it (`torchrun --nproc-per-node N train.py`)."
    )


def prepare(target: str, argv: Sequence[str] = (), *, module: bool = False, no_python: bool = False,
            log_dir: str | None = None, console_ranks: Sequence[int] | None = None,
            what: str = "distributed.run_script", run_path: bool = False) -> ScriptTarget:  # fmt: skip
    """A checked ScriptTarget, or ConfigError naming what is missing and how to fix it."""
    refuse_inside_a_rank(what)
    if not isinstance(target, str) or not target:
        raise ConfigError(f"{what}: the target is {target!r}; expected a script path, a module name or a program.")
    if isinstance(argv, str) or not all(isinstance(a, str) for a in argv):
        raise ConfigError(
            f"{what}: argv={argv!r}; expected a list of strings, e.g. [\"--epochs\", \"3\"] (not one string)."
        )
    if module and no_python:
        raise ConfigError(f"{what}: both module and no-python were asked for; expected at most one (-m or --no-python).")
    if no_python:
        found = shutil.which(target)
        if found is None:
            raise ConfigError(
                f"{what}: program {target!r} (--no-python) was not found on PATH. Expected an executable; "
                f"give its full path, or drop --no-python to run a Python script."
            )
        kind, name = "program", found
    elif module:
        if _find_module(target) is None:
            raise ConfigError(
                f"{what}: module {target!r} (-m) cannot be found from {os.getcwd()} and sys.path. Expected an "
                f"importable module; check its spelling, install its package, or run from the folder that holds it."
            )
        kind, name = "module", target
    else:
        path = Path(target)
        if not (path.is_file() or (path / "__main__.py").is_file()):
            hint = f" `{target}` names a module: add -m (module=True)." if _find_module(target) is not None else ""
            folder = " (a folder without __main__.py)" if path.is_dir() else ""
            raise ConfigError(
                f"{what}: script {target!r} does not exist{folder} (looked in {os.getcwd()}). Expected a path to a "
                f"Python file, or a folder or zip with __main__.py; check the path, or pass a module with -m.{hint}"
            )
        kind, name = ("run_path", target) if run_path else ("path", str(path.resolve()))
    return ScriptTarget(kind, name, typed=target, argv=tuple(argv),
                        log_dir=str(Path(log_dir).resolve()) if log_dir else None,
                        console_ranks=tuple(console_ranks) if console_ranks is not None else None)  # fmt: skip


def _find_module(name: str) -> Any:
    if not name or name.endswith(".py") or "/" in name:
        return None
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the current folder is importable
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def resolve_nprocs(value: int | str | None, backend: str | None = None, *, flag: str = "nprocs") -> tuple[int, str | None]:
    """How many ranks to start, and the backend a word implies ("cpu": gloo), from a number or a torchrun word."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value is None:
        return plan_layout(None, backend).nprocs, backend
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ConfigError(
                f"{flag}={value}; expected a whole number of ranks >= 1, or one of {', '.join(NPROC_WORDS)}. "
                f"Pass e.g. {flag}=2."
            )
        return value, backend
    if value not in NPROC_WORDS:
        raise ConfigError(
            f"{flag}={value!r}; expected a whole number of ranks >= 1, or one of {', '.join(NPROC_WORDS)} "
            f"(as torchrun accepts). Pass e.g. {flag}=2."
        )
    cards = plan_layout(None, None).nprocs if _has_cards() else 0
    if value == "gpu":
        if cards == 0:
            raise ConfigError(
                f"{flag}=gpu but this process sees no CUDA card{devices.visible_devices_note()}. Expected at least one "
                f"card; pass a number of CPU ranks instead ({flag}=2, on gloo) or {flag}=cpu."
            )
        return cards, backend
    if value == "auto" and cards:
        return cards, backend
    return os.cpu_count() or 1, "gloo"


def _has_cards() -> bool:
    """Cards to run ranks on: this job's (simulated ones included), or the visible CUDA cards."""
    job = current_job()
    return (job is not None and job.gpu_count > 0) or visible_card_count() > 0


def say_one_thread_each(nprocs: int) -> None:
    """Say once, as torchrun does, that each of `nprocs` ranks gets OMP_NUM_THREADS=1 (when distributed.run gives it)."""
    if one_thread_each(nprocs):
        print(
            f"levers9: OMP_NUM_THREADS is unset; each of the {nprocs} ranks gets OMP_NUM_THREADS=1 (as torchrun does) so "
            f"the ranks do not oversubscribe the CPU cores. Set OMP_NUM_THREADS to choose another number.",
            file=sys.stderr,
            flush=True,
        )


def with_log_folder(script: ScriptTarget) -> ScriptTarget:
    """`script` with its log folder replaced by a fresh one made under it (mode 0700, a new random name, as
    torchrun makes), said once; so nothing another user planted in a shared log folder is written through.
    ConfigError naming the folder if it cannot be made."""
    if script.log_dir is None:
        return script
    try:
        os.makedirs(script.log_dir, exist_ok=True)
        fresh = tempfile.mkdtemp(prefix=f"levers9-{time.strftime('%Y%m%d-%H%M%S')}-", dir=script.log_dir)
    except OSError as exc:
        raise ConfigError(
            f"distributed.run_script: cannot make a log folder in {script.log_dir} ({exc.strerror or exc}). Expected a folder you "
            f"can write; pass another log folder (--log-dir / log_dir=), or leave it out."
        ) from None
    print(f"levers9: each rank's output is copied to {fresh}/<local rank>/{{stdout,stderr}}.log", file=sys.stderr,
          flush=True)  # fmt: skip
    return dataclasses.replace(script, log_dir=fresh)


def run_script_target(script: ScriptTarget) -> None:
    """What each rank of run_script does: run the target as __main__ (in place, as a world of one, if no rank was started)."""
    if detect.launch_info().launcher == "single":
        _run_script_in_place(script)
        return
    fresh_logging()  # the script starts with a fresh interpreter's root logger, as under torchrun
    default_handlers_in_rank()  # and with the signal handlers a fresh process has (levers9 run --signals-to-handle)
    local = detect.launch_info().local_rank
    if script.console_ranks is not None and local not in script.console_ranks:
        _silence_console()
    with _copies_to(script.log_dir, local):
        if script.kind == "program":
            sys.stdout.flush()
            sys.stderr.flush()
            os.execv(script.name, [script.name, *script.argv])
        _run_as_main(script)


def _run_as_main(script: ScriptTarget) -> None:
    """Run a Python script, folder or module as __main__ with sys.argv set, as `python script.py args` would:
    sys.argv[0] as typed, __file__ absolute, __builtins__ the builtins module, the script's folder first on sys.path."""
    if script.kind == "module":
        sys.argv = [script.name, *script.argv]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(script.name, run_name="__main__", alter_sys=True)
        return
    sys.argv = [script.typed or script.name, *script.argv]
    # torchrun --run-path (the path as given), or a folder or zip (a zipapp, pex, shiv) with __main__.py: runpy puts
    # it first on sys.path, as python does
    if script.kind == "run_path" or os.path.isdir(script.name) or zipfile.is_zipfile(script.name):
        runpy.run_path(script.name, run_name="__main__")
        return
    sys.path.insert(0, os.path.dirname(script.name))
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=script.name, __builtins__=builtins, __cached__=None, __spec__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", script.name))  # fmt: skip
    with open(script.name, "rb") as f:
        code = compile(f.read(), script.name, "exec")
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        sys.modules["__main__"] = saved


def _run_script_in_place(script: ScriptTarget) -> None:
    """One rank: run the target in this process under torchrun's variables for a world of one, then put back
    sys.argv, sys.path and the environment; a sys.exit(N) with N != 0 becomes RankCrashed, as with more ranks."""
    if script.kind == "program":
        with hosted_store() as port:
            code = subprocess.call([script.name, *script.argv], env={**os.environ, **rank_vars(0, 1, port)})
        if code != 0:
            _raise_exit(code if code > 0 else None, -code if code < 0 else None, f"program {script.name}")
        return
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    with hosted_store() as port, _environment(rank_vars(0, 1, port)):
        try:
            _run_as_main(script)
        except SystemExit as exc:
            code = exit_status(exc)
            if code != 0:
                _raise_exit(code, None, f"{script.kind} {script.name}")
        finally:
            td = detect.live_group()
            if td is not None:
                td.destroy_process_group()  # the script's group: in its own process it would end with it
            sys.argv[:], sys.path[:] = saved_argv, saved_path


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """`variables` set in os.environ for the block; afterwards os.environ is as it was before (what the block
    added removed, what it changed put back), as a script's own process would leave the caller's."""
    saved = dict(os.environ)
    os.environ.update(variables)
    try:
        yield
    finally:
        for name in [name for name in os.environ if name not in saved]:
            del os.environ[name]
        for name, value in saved.items():
            if os.environ.get(name) != value:
                os.environ[name] = value


def _raise_exit(code: int | None, signum: int | None, what: str) -> None:
    kind = FailureKind.EXIT if signum is None else FailureKind.CRASH
    failure = RankFailure(rank=0, pid=os.getpid(), exitcode=code, signal=signum, kind=kind)
    raise RankCrashed(f"distributed.run_script: {what} on rank 0 {failure.how()}.", failure)


def _silence_console() -> None:
    """Send this rank's stdout and stderr to /dev/null (--local-ranks-filter left it out)."""
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)


class _Tee(io.TextIOBase):
    """A text stream that writes to the console stream and to a log file."""

    def __init__(self, console: TextIO, copy: TextIO) -> None:
        self.console, self.copy = console, copy

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.console.write(text)

    def flush(self) -> None:
        self.copy.flush()
        self.console.flush()

    def fileno(self) -> int:
        return self.console.fileno()


@contextlib.contextmanager
def _copies_to(log_dir: str | None, local_rank: int) -> Iterator[None]:
    """With a log folder, copy what Python writes to stdout/stderr into LOG_DIR/<local rank>/{stdout,stderr}.log."""
    if log_dir is None:
        yield
        return
    folder = Path(log_dir) / str(local_rank)  # log_dir: this run's own 0700 folder (with_log_folder)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    with _private_log(folder / "stdout.log") as out, _private_log(folder / "stderr.log") as err:
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(saved[0], out), _Tee(saved[1], err)
        try:
            yield
        except BaseException:
            traceback.print_exc(file=err)
            raise
        finally:
            sys.stdout, sys.stderr = saved


def _private_log(path: Path) -> TextIO:
    """`path` opened to append lines, created 0600, never through a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return open(fd, "a", buffering=1)  # noqa: SIM115 - the caller's with closes it


def failure_of(exc: BaseException) -> RankFailure | None:
    """The RankFailure behind `exc` (a RankFailed, or a rank's own exception raised from one), else None."""
    failed = rank_failed_behind(exc)
    return None if failed is None else failed.failure


def exit_code_for(exc: BaseException) -> int:
    """The exit status torchrun gives for this failure: 128+N for signal N, the code of sys.exit(N), 1 otherwise."""
    failure = failure_of(exc)
    if failure is None:
        return 1
    if failure.signal:
        return 128 + failure.signal
    return 1 if failure.exc_type or not failure.exitcode else failure.exitcode


def user_traceback(text: str) -> str:
    """A rank's traceback without the leading frames of levers9 and runpy that ran the script."""
    out: list[str] = []
    skipping = dropping = False  # in a traceback's leading frames; in the source lines of a dropped frame
    for line in text.splitlines():
        if dropping and line.startswith("    "):
            continue
        dropping = False
        if line.startswith("Traceback (most recent call last):"):
            skipping = True
        elif skipping and line.startswith('  File "'):
            if line.split('"')[1].startswith(_LIBRARY_FILES):
                dropping = True
                continue
            skipping = False
        out.append(line)
    return "\n".join(out)
