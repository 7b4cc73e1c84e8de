"""What a job asks for (`JobSpec`), built from @job's arguments and checked once, at decoration time.

Every rule here is static: no file or hardware is read. The workspace policy (cap, switch) and the
machine's feasibility are checked per call, in policy.py and by the backend.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from levers9.distributed.hardware.gpu_types import parse_gpu_type
from levers9.errors import JobConfigError
from levers9.launch import slurm_options
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
    slurm: tuple[tuple[str, str], ...] = ()  # @job(slurm={...}), checked (slurm_options.py)

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
    slurm: Any = None,
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
        slurm=slurm_options.check(slurm),
    )


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
