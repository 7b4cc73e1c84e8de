"""What a job asks for (`JobSpec`), built from @job's arguments and checked once, at decoration time
(no file or hardware is read); and the per-call checks of the workspace policy and the local machine.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from levers9.distributed.hardware.gpu_types import parse_gpu_type
from levers9.errors import InfeasibleJobError, JobConfigError, WorkspacePolicyError
from levers9.launch.pool import SIMULATE_VAR, Pool
from levers9.launch.settings import BACKEND_OPTIONS, Settings, backend_options
from levers9.retries import Retries, RetryPolicy, checked_max_restarts
from levers9.seconds import is_seconds

ANY = "any"
RESERVED_ENV = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MEMORY = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|KB|MB|GB|TB|K|M|G|T)?\s*\Z", re.IGNORECASE)
_MIB_PER_UNIT = {
    None: 1.0,
    "ki": 1 / 1024, "mi": 1.0, "gi": 1024.0, "ti": 1024.0**2,
    "kb": 1000 / 2**20, "mb": 1e6 / 2**20, "gb": 1e9 / 2**20, "tb": 1e12 / 2**20,
    "k": 1 / 1024, "m": 1.0, "g": 1024.0, "t": 1024.0**2,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """A job's request, as a backend sees it. `gpu_types` empty means any type; gpu_count 0 is a CPU job."""

    name: str
    gpu_types: tuple[str, ...] = ()
    gpu_count: int = 0
    timeout: float | None = None
    retries: RetryPolicy = Retries(0)
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cpu: float | None = None
    memory_mib: int | None = None
    queue_timeout: float | None = None
    stop_grace: float = 10.0
    stream_output: bool = True
    stall_timeout: float | None = None
    max_restarts: int = 0
    # @job(<backend>={...}): each backend's own options, checked by it, as (backend, sorted (key, text) pairs)
    backend_options: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()

    def options_for(self, backend: str) -> tuple[tuple[str, str], ...]:
        """What @job(<backend>={...}) asked of `backend`, checked; () when nothing."""
        return dict(self.backend_options).get(backend, ())

    def describe_cards(self) -> str:
        """'2 RTXPro6000 cards', '1 card of any type', 'no card'."""
        if self.gpu_count == 0:
            return "no card"
        kind = "/".join(self.gpu_types) if self.gpu_types else ""
        noun = "card" if self.gpu_count == 1 else "cards"
        return f"{self.gpu_count} {kind} {noun}" if kind else f"{self.gpu_count} {noun} of any type"


def build_spec(
    *,
    name: str,
    gpu: str | Sequence[str] | None,
    gpu_count: Any,
    timeout: Any,
    retries: Any,
    env: Any,
    cpu: Any,
    memory: Any,
    queue_timeout: Any,
    stop_grace: Any,
    stream_output: bool,
    stall_timeout: Any = None,
    max_restarts: Any = 0,
    backend_options: Mapping[str, Any] | None = None,
) -> JobSpec:
    """Check @job's arguments and return the spec; JobConfigError (seen, expected, fix) on the first bad one."""
    types, count = _gpu(gpu, gpu_count)
    return JobSpec(
        name=name,
        gpu_types=types,
        gpu_count=count,
        timeout=_seconds("timeout", timeout),
        retries=_retries(retries),
        env=_env(env),
        cpu=_cpu(cpu),
        memory_mib=_memory(memory),
        queue_timeout=_seconds("queue_timeout", queue_timeout),
        stop_grace=_seconds("stop_grace", stop_grace) or 0.0,
        stream_output=bool(stream_output),
        stall_timeout=_seconds("stall_timeout", stall_timeout),
        max_restarts=checked_max_restarts(
            max_restarts, JobConfigError, " retries= is the other knob: it runs the whole job again."
        ),
        backend_options=_backend_options(backend_options or {}),
    )


def _backend_options(given: Mapping[str, Any]) -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    """@job's keywords that are not its own: each must name a backend with options, which checks its value."""
    out = []
    for name, value in sorted(given.items()):
        if name not in BACKEND_OPTIONS:
            raise JobConfigError(
                f"@job got the keyword {name}={value!r}, which is neither one of its arguments nor a backend's "
                f"options. Expected @job's arguments (gpu, gpu_count, timeout, retries, env, cpu, memory, name, "
                f"queue_timeout, stop_grace, stream_output, stall_timeout, max_restarts, backend) or a backend's "
                f"options under its name ({', '.join(f'{b}={{...}}' for b in BACKEND_OPTIONS)}); check its spelling."
            )
        checked = backend_options(name).check(value, f"{name}=")
        if checked:
            out.append((name, checked))
    return tuple(out)


def _gpu(gpu: str | Sequence[str] | None, gpu_count: Any) -> tuple[tuple[str, ...], int]:
    if gpu_count is not None and (isinstance(gpu_count, bool) or not isinstance(gpu_count, int)):
        raise JobConfigError(
            f"gpu_count must be an int, got {type(gpu_count).__name__} {gpu_count!r}. "
            f"Use gpu_count=1, 2, 4 or 8 (or leave gpu and gpu_count out for a CPU job)."
        )
    if gpu_count is not None and gpu_count < 0:
        raise JobConfigError(f"gpu_count must be 0 or more, got {gpu_count}. Use gpu_count=1, 2, 4 or 8.")
    if gpu is None:
        return (), (gpu_count or 0)
    texts = [gpu] if isinstance(gpu, str) else list(gpu)
    if not texts:
        raise JobConfigError(
            "gpu=[] lists no GPU type. Name one (gpu='RTXPro6000'), or use gpu=None for a CPU job."
        )
    types: list[str] = []
    suffix_count: int | None = None
    for text in texts:
        if not isinstance(text, str):
            raise JobConfigError(f"gpu={gpu!r}: expected a GPU type name such as 'RTXPro6000', got {text!r}.")
        base, _, suffix = text.partition(":")
        if suffix:
            if not suffix.strip().isdigit() or int(suffix) < 1:
                raise JobConfigError(
                    f"Invalid GPU count in gpu={text!r}: must be a positive integer, as in 'H100:8'."
                )
            suffix_count = int(suffix)
        name = ANY if base.strip().lower() == ANY else parse_gpu_type(base)
        if name not in types:
            types.append(name)
    if ANY in types and len(types) > 1:
        raise JobConfigError(
            f"gpu={gpu!r}: 'any' must be used alone. Use gpu='any' or list only named types."
        )
    if suffix_count is not None:
        if gpu_count is not None and gpu_count != suffix_count:
            raise JobConfigError(
                f"gpu={gpu!r} already asks for {suffix_count} cards but gpu_count={gpu_count}; drop one of them."
            )
        gpu_count = suffix_count
    if gpu_count is None:
        gpu_count = 1
    if gpu_count == 0:
        raise JobConfigError(
            f"gpu={gpu!r} with gpu_count=0 asks for a card type but no cards. "
            f"Use gpu_count=1 or more, or gpu=None for a CPU job."
        )
    return (() if types == [ANY] else tuple(types)), gpu_count


_EXAMPLE = {"timeout": 3600, "queue_timeout": 600, "stop_grace": 10, "stall_timeout": 300}


def _seconds(name: str, value: Any) -> float | None:
    """A finite number of seconds: more than 0 (stop_grace: 0 or more), or None (stop_grace: none)."""
    if value is None:
        return None
    least_ok = name == "stop_grace"
    if not is_seconds(value, zero_ok=least_ok):
        expected = (
            "a finite number of seconds, 0 or more (0: SIGKILL at once)"
            if least_ok
            else "a positive number of seconds, or None for no limit"
        )
        raise JobConfigError(
            f"{name} must be {expected}; got {value!r} ({type(value).__name__}). "
            f"Use e.g. @job({name}={_EXAMPLE.get(name, 60)})."
        )
    return float(value)


def _retries(value: Any) -> RetryPolicy:
    if isinstance(value, RetryPolicy):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10:
        raise JobConfigError(
            f"retries must be an int from 0 to 10 or levers9.launch.Retries(...), got {value!r}."
        )
    return Retries(value)


def _env(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise JobConfigError(f"env must be a dict of str to str, got {type(value).__name__}.")
    out: dict[str, str] = {}
    for key, val in value.items():
        if not isinstance(key, str) or not _ENV_KEY.match(key):
            raise JobConfigError(
                f"env key {key!r} is not a valid environment variable name (letters, digits, _)."
            )
        if key in RESERVED_ENV or key.startswith("LEVERS9_"):
            raise JobConfigError(
                f"env may not set {key}: levers9 pins cards and sets LEVERS9_* itself. "
                f"Choose the cards with gpu= and gpu_count= instead."
            )
        if not isinstance(val, str):
            raise JobConfigError(
                f"env[{key!r}] must be a str, got {type(val).__name__} {val!r}. Write env={{{key!r}: {str(val)!r}}}."
            )
        out[key] = val
    return out


def _cpu(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, str) and value.endswith("m") and value[:-1].isdigit():
        value = int(value[:-1]) / 1000
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.1 <= value <= 256:
        raise JobConfigError(f"cpu must be a number of cores from 0.1 to 256 (or '500m'), got {value!r}.")
    return float(value)


def _memory(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise JobConfigError(f"memory must be MiB as an int or a size such as '64Gi', got {value!r}.")
    if isinstance(value, (int, float)):
        mib = float(value)
    else:
        match = _MEMORY.match(str(value))
        if not match:
            raise JobConfigError(
                f"memory must be MiB as an int or a size such as '64Gi' or '512Mi', got {value!r}."
            )
        unit = match.group(2).lower() if match.group(2) else None
        mib = float(match.group(1)) * _MIB_PER_UNIT[unit]
    if mib <= 0:
        raise JobConfigError(f"memory must be greater than 0, got {value!r}.")
    return max(1, int(mib))


# Per-call checks, before anything starts, in beta9's order: the workspace's card cap, its multi-GPU switch
# (`check_policy`, for every backend), then feasibility (`check_feasible`, the local executor's).


def check_policy(spec: JobSpec, settings: Settings) -> None:
    """WorkspacePolicyError if the job asks for more cards than the cap, or for several with the switch off."""
    if spec.gpu_count > settings.max_gpu_count:
        raise WorkspacePolicyError(
            f"GPU count must be {settings.max_gpu_count} or less (job {spec.name!r} asks for {spec.gpu_count}; "
            f"the limit is limits.max_gpu_count in {settings.path}). Ask for fewer cards, or raise the limit "
            f"with: levers9 workspace max-gpu-count {spec.gpu_count}"
        )
    if spec.gpu_count > 1 and not settings.multi_gpu:
        raise WorkspacePolicyError(
            f"Multi-GPU jobs are not enabled for this workspace (job {spec.name!r} asks for {spec.gpu_count} "
            f"cards; the switch is workspace.multi_gpu in {settings.path}, now off). Turn them on with: "
            f"levers9 workspace multi-gpu on"
        )


def check_feasible(spec: JobSpec, pool: Pool) -> list[list[int]]:
    """The slot groups the job may take from; InfeasibleJobError if no group could ever hold it."""
    want = spec.describe_cards()
    if pool.held_by:
        return _check_nested(spec, pool)
    if not pool.cards:
        raise InfeasibleJobError(
            f"Job {spec.name!r} asks for {want} but this machine has no NVIDIA GPU that levers9 can see "
            f"(NVML found none{', or CUDA_VISIBLE_DEVICES hides them' if pool.source == 'NVML' else ''}). "
            f"For tests, set {SIMULATE_VAR}='RTXPro6000:4' (or [local].simulate_gpus in workspace.toml); "
            f"for a CPU job, use gpu=None."
        )
    groups = [g for g in pool.groups(spec.gpu_types) if g]
    if not groups:
        have = pool.describe()
        first = next(iter(dict.fromkeys(c.type_name for c in pool.cards)))
        raise InfeasibleJobError(
            f"Job {spec.name!r} asks for {'/'.join(spec.gpu_types)} but this machine has {have}; "
            f"use gpu={first!r} or gpu='any'."
        )
    if max(len(g) for g in groups) < spec.gpu_count:
        raise InfeasibleJobError(
            f"Job {spec.name!r} needs {want} at once; the largest group of such cards on this machine has "
            f"{max(len(g) for g in groups)} (local machine: {pool.describe()}). Ask for at most that many "
            f"with gpu_count=, or run it where more cards are attached."
        )
    return groups


def _check_nested(spec: JobSpec, pool: Pool) -> list[list[int]]:
    """For a job started inside a job: its caller's cards must be able to hold it, or it fails now."""
    groups = [g for g in pool.groups(spec.gpu_types) if g]
    if groups and max(len(g) for g in groups) >= spec.gpu_count:
        return groups
    visible = ",".join(str(c.nvml_index) for c in pool.cards)
    raise InfeasibleJobError(
        f"Job {spec.name!r} asks for {spec.describe_cards()} but was started inside job {pool.held_by}, which "
        f"holds {pool.summary()} (CUDA_VISIBLE_DEVICES={visible}). A job started inside a job runs on its "
        f"caller's cards: the caller keeps its cards while it waits, so waiting for other cards could "
        f"deadlock (callers holding every card, each waiting for an inner job that needs one). Ask the inner "
        f"job for at most {pool.summary()} (gpu_count=, gpu=), give the outer job the cards the inner one "
        f"needs, or start the inner jobs from the top-level script rather than from inside a job."
    )
