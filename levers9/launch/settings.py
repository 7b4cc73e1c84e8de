"""Workspace settings: the multi-GPU switch and the per-job card cap, in one small TOML file; and where
levers9 keeps run state (card leases, per-job logs).

The file is read afresh on every job submission, so a change takes effect on the next call. A missing
file means the defaults; a corrupt file is a SettingsError naming it, never a silent default. Writes
are atomic under an flock, so readers see the whole old file or the whole new one. The file, its folder
and its lock are obeyed only if they are this user's, not symlinks, not FIFOs and not writable by others.
A bad value is an error naming the command that sets it, and that command repairs the file.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib
import logging
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from levers9.errors import ConfigError, SettingsError
from levers9.private_dir import check_private, private_dir
from levers9.runtime import current_job
from levers9.state_files import StateFileError, read_private, write_atomic

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

log = logging.getLogger("levers9.launch")

FILE_NAME = "workspace.toml"
DEFAULT_MULTI_GPU = False
DEFAULT_MAX_GPU_COUNT = 8
MAX_GPU_COUNT_LIMIT = 1024


@dataclasses.dataclass(frozen=True)
class _Key:
    """A key this file may hold: what its value must be (said and checked) and the command that rewrites it."""

    expected: str
    valid: Callable[[Any], bool]
    fix: str = ""  # also the fix for its table when the table is not a table


def _is_card_cap(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_GPU_COUNT_LIMIT


# The keys this file may hold, by (table, key).
_KNOWN: dict[tuple[str, str], _Key] = {
    ("workspace", "multi_gpu"): _Key("true or false", lambda v: isinstance(v, bool),
                                     "levers9 workspace multi-gpu on|off"),
    ("workspace", "name"): _Key("a string", lambda v: isinstance(v, str)),
    ("limits", "max_gpu_count"): _Key(f"an integer from 1 to {MAX_GPU_COUNT_LIMIT}", _is_card_cap,
                                      "levers9 workspace max-gpu-count N"),
    ("local", "simulate_gpus"): _Key('a string such as "RTXPro6000:4"', lambda v: isinstance(v, str)),
}  # fmt: skip

# A backend's options live with the backend: its module of them checks `@job(<name>={...})` (`check`) and owns the
# table of this file under the backend's name (`SETTINGS`: key -> what it must be, each a string). Loaded only
# where a job uses that backend, so a local map loads no other backend's code.
BACKEND_OPTIONS: dict[str, str] = {"slurm": "levers9.launch.slurm"}


def backend_options(name: str) -> Any:
    """The options module of backend `name` (one of BACKEND_OPTIONS)."""
    return importlib.import_module(BACKEND_OPTIONS[name])


@dataclasses.dataclass(frozen=True)
class Settings:
    """The effective workspace settings and the file they came from."""

    path: Path
    exists: bool = False
    name: str = "local"
    multi_gpu: bool = DEFAULT_MULTI_GPU
    max_gpu_count: int = DEFAULT_MAX_GPU_COUNT
    simulate_gpus: str | None = None
    # a backend's own table, as the file has it ([slurm]: what its jobs ask for unless @job(slurm={...}) says
    # otherwise); checked by the backend's options when it reads it, so a local job never loads SLURM's code
    backend_tables: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def backend_table(self, name: str) -> dict[str, str]:
        """The file's table of backend `name`: the keys its options module names, each a string (others logged
        and ignored); {} when the file has none. SettingsError on a bad value."""
        known: Mapping[str, str] = backend_options(name).SETTINGS
        checked: dict[str, str] = {}
        for key, value in self.backend_tables.get(name, {}).items():
            if key not in known:
                log.warning("%s: ignoring unknown key %s.%s (expected some of: %s)", self.path, name, key, ", ".join(known))
            elif not isinstance(value, str):
                raise SettingsError(
                    f"{self.path}: {name}.{key} must be {known[key]}, got {value!r}. Fix it with: edit {self.path}"
                )
            else:
                checked[key] = value
        return checked


def _levers9_dir(env: Mapping[str, str] | None, own: str, xdg: str, dot: str) -> Path:
    """$`own`, else ${`xdg`:-~/`dot`}/levers9; ConfigError naming both variables when the home folder is
    needed and there is none (HOME unset and no passwd entry)."""
    env = os.environ if env is None else env
    if env.get(own):
        return Path(env[own]).expanduser()
    base = env.get(xdg)
    if not base:
        try:
            base = str(Path.home() / dot)
        except RuntimeError:
            raise ConfigError(
                f"levers9 cannot tell your home folder (HOME is not set, and uid {os.getuid()} has no passwd "
                f"entry). Fix: set {own} or {xdg} to a folder you can write."
            ) from None
    return Path(base).expanduser() / "levers9"


def settings_path(env: os._Environ[str] | dict[str, str] | None = None) -> Path:
    """Where the workspace settings file is (whether or not it exists): $LEVERS9_CONFIG_DIR/workspace.toml,
    else ${XDG_CONFIG_HOME:-~/.config}/levers9/workspace.toml."""
    return _levers9_dir(env, "LEVERS9_CONFIG_DIR", "XDG_CONFIG_HOME", ".config") / FILE_NAME


def lease_dir(env: os._Environ[str] | dict[str, str] | None = None) -> Path:
    """The folder of card lease locks: $LEVERS9_STATE_DIR/leases, else $XDG_RUNTIME_DIR/levers9/leases,
    else /tmp/levers9-<uid>/leases (a local file system, where flock is reliable). Inside a job that
    holds cards: <the job's folder>/leases, where jobs it starts lease its own cards."""
    return lease_dirs(env)[0]


def lease_dirs(env: os._Environ[str] | dict[str, str] | None = None) -> tuple[Path, Path | None]:
    """lease_dir(), and where leases go when it cannot be written (a full or read-only state folder):
    the next folder of that list, or for a job's own cards a folder of that job's under the temp dir;
    None when lease_dir() is the last of the list already."""
    env = os.environ if env is None else env
    temp = Path(tempfile.gettempdir()) / f"levers9-{os.getuid()}"
    job = current_job()
    if job is not None and job.gpu_count > 0:
        return Path(job.job_dir) / "leases", temp / "jobs" / f"{job.run_id}-{job.cell_index}" / "leases"
    places = [Path(env["LEVERS9_STATE_DIR"]).expanduser() / "leases"] if env.get("LEVERS9_STATE_DIR") else []
    if env.get("XDG_RUNTIME_DIR"):
        places.append(Path(env["XDG_RUNTIME_DIR"]) / "levers9" / "leases")
    places.append(temp / "leases")
    return places[0], places[1] if len(places) > 1 else None


def runs_dir(env: os._Environ[str] | dict[str, str] | None = None) -> Path:
    """The folder of per-job logs: $LEVERS9_STATE_DIR/runs, else ${XDG_CACHE_HOME:-~/.cache}/levers9/runs."""
    return _levers9_dir(env, "LEVERS9_STATE_DIR", "XDG_CACHE_HOME", ".cache") / "runs"


CONFIG_FIX = (
    "set LEVERS9_CONFIG_DIR to a folder of your own that you can write (e.g. export LEVERS9_CONFIG_DIR="
    "~/.levers9-config), or XDG_CONFIG_HOME"
)
_MAX_BYTES = 1 << 20  # a settings file larger than this is not one levers9 wrote


def load_settings(path: Path | None = None) -> Settings:
    """Read the settings file now (defaults if it is missing); SettingsError if it is corrupt or
    invalid, or not a file of this user's in a folder of this user's (then it is never obeyed)."""
    return _load(settings_path() if path is None else path, repairing=())


def _load(path: Path, repairing: tuple[str, ...]) -> Settings:
    """load_settings, passing over bad values of the keys in `repairing` (which are about to be set)."""
    if not check_private(path.parent, fix=CONFIG_FIX):
        return Settings(path=path)
    try:
        raw = read_private(path, limit=_MAX_BYTES)
    except FileNotFoundError:
        return Settings(path=path)
    except StateFileError as exc:
        raise SettingsError(
            f"Refusing the workspace settings file {path}: {exc.strerror}. levers9 obeys only a regular file of "
            f"your own that others cannot write. Fix: remove it (rm {path}) and run `levers9 workspace multi-gpu "
            f"off` to write your own, or {CONFIG_FIX}."
        ) from None
    except OSError as exc:
        raise SettingsError(
            f"Cannot read the workspace settings file {path}: {exc.strerror or exc}. Fix its permissions "
            f"(chmod u+r {path}), or {CONFIG_FIX}."
        ) from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SettingsError(
            f"The workspace settings file {path} is not valid TOML ({exc}). Expected a file such as "
            f"levers9 writes; fix it, or delete it and run `levers9 workspace multi-gpu off` to write a fresh one."
        ) from exc
    return _from_dict(data, path, repairing)


def _from_dict(data: dict[str, Any], path: Path, repairing: tuple[str, ...] = ()) -> Settings:
    """Validate the parsed file: known keys with the right types; unknown keys are logged and ignored.
    A bad value of a key in `repairing` (or of the table holding it) is passed over: it is being set."""
    values: dict[str, Any] = {}
    backend_tables: dict[str, dict[str, Any]] = {}
    tables = {table for table, _ in _KNOWN} | set(BACKEND_OPTIONS)
    for table, body in data.items():
        if table == "version":
            continue
        if not isinstance(body, dict):
            if table not in tables:
                log.warning("%s: ignoring unknown top-level key %r", path, table)
            elif not any(t == table and k in repairing for t, k in _KNOWN):
                raise SettingsError(
                    f"{path}: {table} must be a table ([{table}] and its keys below it), got {body!r}. "
                    f"Fix it with: {_fix(path, table)}"
                )
            continue
        if table in BACKEND_OPTIONS:
            backend_tables[table] = body
            continue
        for key, value in body.items():
            if (table, key) not in _KNOWN:
                log.warning("%s: ignoring unknown key %s.%s", path, table, key)
            else:
                try:
                    values[key] = _check_value(path, table, key, value)
                except SettingsError:
                    if key not in repairing:
                        raise
    return Settings(path=path, exists=True, backend_tables=backend_tables, **values)


def _check_value(path: Path, table: str, key: str, value: Any) -> Any:
    known = _KNOWN[(table, key)]
    if not known.valid(value):
        raise SettingsError(
            f"{path}: {table}.{key} must be {known.expected}, got {value!r}. Fix it with: {_fix(path, table, key)}"
        )
    return value


def _fix(path: Path, table: str, key: str | None = None) -> str:
    """The command that rewrites `table.key` (with no key: a key of `table`), else 'edit PATH'."""
    fixes = [known.fix for (t, k), known in _KNOWN.items() if t == table and key in (None, k) and known.fix]
    return fixes[0] if fixes else f"edit {path}"


# A new file starts from this text, so it explains itself; an existing file keeps its own text.
_TEMPLATE = """\
# levers9 workspace settings. Read on every job submission: edits take effect on the next call.
version = 1

[workspace]
name = "local"
multi_gpu = false        # `levers9 workspace multi-gpu on|off`; gates gpu_count > 1

[limits]
max_gpu_count = 8        # per job; `levers9 workspace max-gpu-count N`

[local]
# simulate_gpus = "RTXPro6000:4"   # fake cards for machines without GPUs
"""


def render(settings: Settings, existing: str | None = None) -> str:
    """The file's text for `settings`: the user's `existing` text with levers9's keys set to these values
    (comments, layout and unknown keys kept), or levers9's commented template when there is no file."""
    import tomlkit  # only a write needs it: every job process and SLURM task imports this module to read

    if existing is None:  # a new file: levers9's template, each backend's table explained by the backend
        existing = _TEMPLATE + "".join(backend_options(name).SETTINGS_TEMPLATE for name in BACKEND_OPTIONS)
    doc = tomlkit.parse(existing)
    for table, key in _KNOWN:
        value = getattr(settings, key)
        section = doc.get(table)
        if section is not None and not isinstance(section, (tomlkit.items.Table, tomlkit.items.InlineTable)):
            del doc[table]  # `workspace = 5`: the command that sets a key of it makes it a table again
            section = None
        if section is None or key not in section:
            if value is None or value == getattr(Settings, key):
                continue  # a default the file does not mention stays unmentioned
            if section is None:
                section = doc[table] = tomlkit.table()
        if value is None:
            section.pop(key, None)
        elif section.get(key) != value:
            section[key] = value  # tomlkit keeps the comment that followed the old value
    text = tomlkit.dumps(doc)
    return text if text.endswith("\n") else text + "\n"


def update_settings(path: Path | None = None, **changes: Any) -> tuple[Settings, Settings]:
    """Change some settings atomically under a lock; returns (before, after). The rest of the file is
    kept as written; a bad value of a key being set (or of its table) is replaced, which is how the
    fix an error names repairs the file."""
    path = settings_path() if path is None else path
    private_dir(path.parent, fix=CONFIG_FIX)
    lock_fd = _open_lock(Path(str(path) + ".lock"))
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        before = _load(path, repairing=tuple(changes))
        after = dataclasses.replace(before, exists=True, **changes)
        _check_all(after)
        existing = read_private(path, limit=_MAX_BYTES).decode("utf-8") if before.exists else None
        write_atomic(path, render(after, existing).encode("utf-8"), durable=True)
        return before, after
    finally:
        os.close(lock_fd)


def _open_lock(path: Path) -> int:
    """The settings lock file, opened without following a symlink or blocking; SettingsError unless it
    is a regular file of this user's."""
    fix = f"Fix: remove it (rm {path}; levers9 makes a new one), or {CONFIG_FIX}."
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SettingsError(f"Cannot open the settings lock {path} ({exc.strerror}). {fix}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        os.close(fd)
        raise SettingsError(
            f"Refusing the settings lock {path}: expected a regular file of yours (uid {os.getuid()}) that others "
            f"cannot write, found mode {info.st_mode:o} owned by uid {info.st_uid}. {fix}"
        )
    return fd


def _check_all(settings: Settings) -> None:
    _check_value(settings.path, "workspace", "multi_gpu", settings.multi_gpu)
    _check_value(settings.path, "limits", "max_gpu_count", settings.max_gpu_count)
