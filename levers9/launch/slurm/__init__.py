"""SLURM: a job is an sbatch job (an array for a sweep), its ranks srun tasks, followed through squeue and its
tasks' reports (backend.py and its modules). This face of the package holds what a job asks of SLURM beyond its
cards, @job(slurm={...}) and the workspace's [slurm] table, so that checking them loads nothing else:

    @job(gpu_count=4, backend="slurm", slurm={"partition": "gpu", "account": "lab", "qos": "normal",
                                              "sbatch": "--exclusive --constraint=a100", "max_running": 8})

Checked at decoration time (keys and types); the keyword's values win over the workspace's, key by key.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping
from typing import Any

from levers9.errors import JobConfigError

# key -> what it becomes
KEYS = {
    "partition": "#SBATCH --partition",
    "account": "#SBATCH --account",
    "qos": "#SBATCH --qos",
    "sbatch": "more #SBATCH options, as one string ('--exclusive --constraint=a100')",
    "max_running": "the job array's concurrency limit (#SBATCH --array=0-N%max_running)",
    "detach": "True: the caller's exit or death leaves the jobs running; `levers9 runs result RUN` collects them",
    "requeue": "True, or seconds: SLURM's early signal that many seconds (default 60) before the time limit "
               "requeues the job, which resumes from the function's checkpoint (#SBATCH --signal=USR2@N)",
}
REQUEUE_SIGNAL_S = 60  # requeue=True: the early signal this many seconds before the time limit
# the workspace's [slurm] table (levers9/launch/settings.py reads it through this module): key -> what it must be
SETTINGS = {
    "partition": 'a string: #SBATCH --partition of backend="slurm" jobs',
    "account": 'a string: #SBATCH --account of backend="slurm" jobs',
    "qos": 'a string: #SBATCH --qos of backend="slurm" jobs',
    "sbatch": 'a string of more #SBATCH options, such as "--exclusive --constraint=a100"',
}
# what a new workspace settings file says of that table
SETTINGS_TEMPLATE = """
[slurm]
# partition = "gpu"                # backend="slurm": #SBATCH --partition (also account, qos)
# sbatch = "--exclusive"           # more #SBATCH options; @job(slurm={...}) wins key by key
"""
# the keys whose value is a whole number >= 1 -> what the message says it must be
_WHOLE_KEYS = {"requeue": "True or whole seconds >= 1", "max_running": "a whole number >= 1"}


def check(value: Any, source: str = "slurm=") -> tuple[tuple[str, str], ...]:
    """`value` (a dict of the KEYS, or None) as sorted (key, text) pairs; JobConfigError on a bad key or value."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise JobConfigError(
            f"{source} must be a dict such as {{'partition': 'gpu'}}, got {type(value).__name__} {value!r}."
        )
    out: dict[str, str] = {}
    for key, text in value.items():
        if key not in KEYS:
            raise JobConfigError(
                f"{source} has the key {key!r}; expected some of: "
                + "; ".join(f"{k} ({what})" for k, what in KEYS.items())
                + ". Other #SBATCH options go in 'sbatch'."
            )
        if key == "detach":
            if not isinstance(text, bool):
                raise JobConfigError(f"{source}['detach'] must be True or False, got {text!r}.")
            if text:
                out[key] = "1"
            continue
        if key == "requeue" and text is True:
            text = REQUEUE_SIGNAL_S
        if key in _WHOLE_KEYS:
            if isinstance(text, bool) or not isinstance(text, int) or text < 1:
                raise JobConfigError(f"{source}[{key!r}] must be {_WHOLE_KEYS[key]}, got {text!r}.")
            out[key] = str(text)
            continue
        if not isinstance(text, str) or not text.strip():
            raise JobConfigError(f"{source}[{key!r}] must be a non-empty string, got {text!r}.")
        if key == "sbatch":
            sbatch_options(text, source)
        out[key] = text.strip()
    return tuple(sorted(out.items()))


def sbatch_options(text: str, source: str = "slurm=") -> dict[str, Any]:
    """'--exclusive --constraint=a100 --gres-flags enforce-binding' as submitit's additional_parameters
    ({'exclusive': True, 'constraint': 'a100', ...}); JobConfigError for words that are not options."""
    words = shlex.split(text)
    options: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--") or len(word) < 3:
            raise JobConfigError(
                f"{source}['sbatch'] = {text!r}: {word!r} is not a long sbatch option. Expected options such as "
                f"'--exclusive --constraint=a100' (write short ones long: '-C a100' as '--constraint=a100')."
            )
        name, eq, given = word[2:].partition("=")
        if eq:
            options[name] = given
        elif i + 1 < len(words) and not words[i + 1].startswith("--"):
            options[name] = words[i + 1]
            i += 1
        else:
            options[name] = True
        i += 1
    return options


def early_signal_s(options: Mapping[str, str]) -> int:
    """How long before the time limit SLURM is to send the job its early signal (#SBATCH --signal=USR2@N, which
    submitit puts in every job): `requeue`'s seconds; else 0, for which SLURM sends none (it may send one up to a
    minute early: it would kill a run that starts in that minute, before any handler, and no job needs it)."""
    return int(options.get("requeue", 0))


def merged(job: Iterable[tuple[str, str]], workspace: Mapping[str, str | None]) -> dict[str, str]:
    """The workspace's values overridden, key by key, by the job's."""
    out = {key: value for key, value in workspace.items() if value}
    out.update(dict(job))
    return out
