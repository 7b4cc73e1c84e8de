"""Workspace settings: the multi-GPU switch and the per-job card cap, in one small TOML file.

The file is `$LEVERS9_CONFIG_DIR/workspace.toml` when that variable is set, else
`${XDG_CONFIG_HOME:-~/.config}/levers9/workspace.toml`. It is read afresh on every job submission,
so a change takes effect on the next call. A missing file means the defaults (switch off, cap 8);
a corrupt file is a SettingsError naming it, never a silent default. Writes are atomic (a temporary
file in the same folder, fsync, os.replace) under an flock, so readers see the whole old file or the
whole new one.

Where levers9 keeps run state (card leases, per-job logs) is decided here too.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import tomlkit

from levers9.context import current_job
from levers9.errors import SettingsError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

log = logging.getLogger("levers9.launch")

FILE_NAME = "workspace.toml"
DEFAULT_MULTI_GPU = False
DEFAULT_MAX_GPU_COUNT = 8
MAX_GPU_COUNT_LIMIT = 1024

# The keys this file may hold: (table, key) -> a short description of the expected value.
_KNOWN: dict[tuple[str, str], str] = {
    ("workspace", "multi_gpu"): "true or false",
    ("workspace", "name"): "a string",
    ("limits", "max_gpu_count"): f"an integer from 1 to {MAX_GPU_COUNT_LIMIT}",
    ("local", "simulate_gpus"): 'a string such as "RTXPro6000:4"',
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The effective workspace settings and the file they came from."""

    path: Path
    exists: bool = False
    name: str = "local"
    multi_gpu: bool = DEFAULT_MULTI_GPU
    max_gpu_count: int = DEFAULT_MAX_GPU_COUNT
    simulate_gpus: str | None = None


def config_dir(env: os._Environ[str] | dict[str, str] | None = None) -> Path:
    """$LEVERS9_CONFIG_DIR, else ${XDG_CONFIG_HOME:-~/.config}/levers9."""
    env = os.environ if env is None else env
    if env.get("LEVERS9_CONFIG_DIR"):
        return Path(env["LEVERS9_CONFIG_DIR"]).expanduser()
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "levers9"


def settings_path(env: os._Environ[str] | dict[str, str] | None = None) -> Path:
    """Where the workspace settings file is (whether or not it exists)."""
    return config_dir(env) / FILE_NAME


def lease_dir(env: os._Environ[str] | dict[str, str] | None = None) -> Path:
    """The folder of card lease locks: $LEVERS9_STATE_DIR/leases, else $XDG_RUNTIME_DIR/levers9/leases,
    else /tmp/levers9-<uid>/leases (a local file system, where flock is reliable). Inside a job that
    holds cards: <the job's folder>/leases, where jobs it starts lease its own cards."""
    env = os.environ if env is None else env
    job = current_job()
    if job is not None and job.gpu_count > 0:
        return Path(job.job_dir) / "leases"
    if env.get("LEVERS9_STATE_DIR"):
        return Path(env["LEVERS9_STATE_DIR"]).expanduser() / "leases"
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "levers9" / "leases"
    return Path(tempfile.gettempdir()) / f"levers9-{os.getuid()}" / "leases"


def runs_dir(env: os._Environ[str] | dict[str, str] | None = None) -> Path:
    """The folder of per-job logs: $LEVERS9_STATE_DIR/runs, else ${XDG_CACHE_HOME:-~/.cache}/levers9/runs."""
    env = os.environ if env is None else env
    if env.get("LEVERS9_STATE_DIR"):
        return Path(env["LEVERS9_STATE_DIR"]).expanduser() / "runs"
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "levers9" / "runs"


def load_settings(path: Path | None = None) -> Settings:
    """Read the settings file now (defaults if it is missing); SettingsError if it is corrupt or invalid."""
    path = settings_path() if path is None else path
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Settings(path=path)
    except OSError as exc:
        raise SettingsError(
            f"Cannot read the workspace settings file {path}: {exc}. Fix its permissions."
        ) from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SettingsError(
            f"The workspace settings file {path} is not valid TOML ({exc}). Expected a file such as "
            f"levers9 writes; fix it, or delete it and run `levers9 workspace multi-gpu off` to write a fresh one."
        ) from exc
    return _from_dict(data, path)


def _from_dict(data: dict[str, Any], path: Path) -> Settings:
    """Validate the parsed file: known keys with the right types; unknown keys are logged and ignored."""
    values: dict[str, Any] = {}
    for table, body in data.items():
        if table == "version":
            continue
        if not isinstance(body, dict):
            log.warning("%s: ignoring unknown top-level key %r", path, table)
            continue
        for key, value in body.items():
            if (table, key) not in _KNOWN:
                log.warning("%s: ignoring unknown key %s.%s", path, table, key)
                continue
            values[key] = _check_value(path, table, key, value)
    return Settings(path=path, exists=True, **values)


def _check_value(path: Path, table: str, key: str, value: Any) -> Any:
    ok = {
        "multi_gpu": isinstance(value, bool),
        "name": isinstance(value, str),
        "max_gpu_count": isinstance(value, int)
        and not isinstance(value, bool)
        and 1 <= value <= MAX_GPU_COUNT_LIMIT,
        "simulate_gpus": isinstance(value, str),
    }[key]
    if not ok:
        fix = {
            "multi_gpu": "levers9 workspace multi-gpu on|off",
            "max_gpu_count": "levers9 workspace max-gpu-count N",
        }.get(key, f"edit {path}")
        raise SettingsError(
            f"{path}: {table}.{key} must be {_KNOWN[(table, key)]}, got {value!r}. Fix it with: {fix}"
        )
    return value


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
    doc = tomlkit.parse(existing if existing is not None else _TEMPLATE)
    for table, key in _KNOWN:
        value = getattr(settings, key)
        section = doc.get(table)
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
    """Change some settings atomically under a lock; returns (before, after). The rest of the file is kept as written."""
    path = settings_path() if path is None else path
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        before = load_settings(path)
        after = dataclasses.replace(before, exists=True, **changes)
        _check_all(after)
        existing = path.read_text(encoding="utf-8") if before.exists else None
        _atomic_write(path, render(after, existing))
        return before, after
    finally:
        os.close(lock_fd)


def _check_all(settings: Settings) -> None:
    _check_value(settings.path, "workspace", "multi_gpu", settings.multi_gpu)
    _check_value(settings.path, "limits", "max_gpu_count", settings.max_gpu_count)


def _atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see either the old or the new file, whole."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
