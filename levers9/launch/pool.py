"""The cards the local executor may hand out: this machine's NVIDIA cards, or a simulated pool.

Real cards come from `levers9.distributed.hardware.cards.visible_cards()` (NVML, honouring the caller's own
CUDA_VISIBLE_DEVICES). Simulated cards come from LEVERS9_SIMULATE_GPUS (or `[local].simulate_gpus`
in workspace.toml), e.g. "RTXPro6000:4" or "RTXPro6000:4,H100:2"; they are leased and pinned by the
same code, and jobs on them see `levers9.current_job().simulated`. The environment variable wins over the file.

Inside a job that holds cards, the pool is that job's own cards, leased in a folder of its own, so the
jobs it starts share them. Waiting for the machine's other cards instead could wait forever: with every
card held by a caller waiting on its inner job, no inner job ever gets one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections import Counter
from collections.abc import Mapping

from levers9.distributed.hardware.cards import visible_cards
from levers9.distributed.hardware.gpu_types import parse_gpu_type
from levers9.errors import JobConfigError
from levers9.runtime import current_job

log = logging.getLogger("levers9.launch")

SIMULATE_VAR = "LEVERS9_SIMULATE_GPUS"


@dataclasses.dataclass(frozen=True)
class PoolCard:
    """One card the pool may lease: its place in the pool, its NVML index and its lock's name."""

    slot: int
    nvml_index: int
    type_name: str
    lock_name: str  # stable across processes: the card UUID for real cards


@dataclasses.dataclass
class Pool:
    """The cards of this machine as the local executor sees them."""

    pool_id: str
    cards: tuple[PoolCard, ...]
    simulated: bool
    source: str  # where the cards came from, for messages
    held_by: str = ""  # the job (its job_id) whose own cards these are, for a job started inside it
    _busy_at: float = 0.0
    _busy: frozenset[int] = frozenset()

    def summary(self) -> str:
        """'4× RTXPro6000, 2× H100' or 'no NVIDIA GPU'."""
        if not self.cards:
            return "no NVIDIA GPU"
        counts = Counter(c.type_name for c in self.cards)
        return ", ".join(f"{n}× {t}" for t, n in counts.items())

    def describe(self) -> str:
        """'4× RTXPro6000 (simulated, LEVERS9_SIMULATE_GPUS)'."""
        return f"{self.summary()} ({self.source})"

    def groups(self, gpu_types: tuple[str, ...]) -> list[list[int]]:
        """Slots a job may take, one list per type, in the job's order of preference (all types when empty)."""
        order = list(gpu_types) or list(dict.fromkeys(c.type_name for c in self.cards))
        return [[c.slot for c in self.cards if c.type_name == t] for t in order]

    def foreign_busy(self) -> frozenset[int]:
        """Slots of real cards that a process other than this one is using (re-read at most once a second)."""
        if self.simulated or self.held_by or not self.cards:  # a caller's cards are busy with the caller
            return frozenset()
        now = time.monotonic()
        if now - self._busy_at > 1.0:
            self._busy_at = now
            self._busy = _read_busy(self.cards)
        return self._busy


def local_pool(env: Mapping[str, str] | None = None, simulate: str | None = None) -> Pool:
    """The pool for this call: simulated when LEVERS9_SIMULATE_GPUS (or `simulate`) is set, else NVML's cards."""
    env = os.environ if env is None else env
    if holds_cards():
        return callers_pool(env)
    spec = env.get(SIMULATE_VAR) or simulate
    if spec:
        source = f"simulated, {SIMULATE_VAR}" if env.get(SIMULATE_VAR) else "simulated, [local].simulate_gpus"
        return simulated_pool(spec, source)
    return _real_pool(env)


def holds_cards() -> bool:
    """True inside a job process (or a rank it started) whose job holds cards."""
    job = current_job()
    return job is not None and job.gpu_count > 0


def callers_pool(env: Mapping[str, str]) -> Pool:
    """The cards of the job this process runs in (its CUDA_VISIBLE_DEVICES), as a pool for jobs it starts."""
    job = current_job()
    assert job is not None, "callers_pool() is for a process inside a job; ask holds_cards() first"
    ids = [i.strip() for i in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if i.strip()]
    source = f"the cards of job {job.job_id}, which started this one"
    if job.simulated:
        type_name = job.gpu_type or "GPU"
        cards = tuple(
            PoolCard(slot, int(i) if i.isdigit() else slot, type_name, f"card{i}") for slot, i in enumerate(ids)
        )
        return Pool(f"job-sim-{len(cards)}", cards, True, f"simulated, {source}", held_by=job.job_id)
    real = _real_pool(env)
    return dataclasses.replace(real, pool_id="job-nvml", source=source, held_by=job.job_id)


def simulated_pool(spec: str, source: str = f"simulated, {SIMULATE_VAR}") -> Pool:
    """Cards from a spec such as 'RTXPro6000:4,H100:2'; JobConfigError naming the variable if it is malformed."""
    cards: list[PoolCard] = []
    for part in spec.split(","):
        name, _, count = part.strip().partition(":")
        count = count.strip() or "1"
        if not name or not count.isdigit() or int(count) < 1:
            raise JobConfigError(
                f"{SIMULATE_VAR}={spec!r}: expected TYPE:COUNT[,TYPE:COUNT], e.g. 'RTXPro6000:4' or 'RTXPro6000:4,H100:2'."
            )
        type_name = parse_gpu_type(name)
        for _ in range(int(count)):
            slot = len(cards)
            cards.append(PoolCard(slot, slot, type_name, f"card{slot}"))
    digest = hashlib.sha1(",".join(c.type_name for c in cards).encode()).hexdigest()[:10]
    return Pool(f"sim-{digest}", tuple(cards), True, source)


def _real_pool(env: Mapping[str, str]) -> Pool:
    found = visible_cards(env)
    cards = tuple(
        PoolCard(slot, c.nvml_index, c.type_name, "card-" + c.uuid.replace("/", "_"))
        for slot, c in enumerate(found)
    )
    return Pool("nvml", cards, False, "NVML")


def _read_busy(cards: tuple[PoolCard, ...]) -> frozenset[int]:
    me = os.getpid()
    by_nvml = {c.nvml_index: c.slot for c in cards}
    return frozenset(
        by_nvml[card.nvml_index]
        for card in visible_cards({}, refresh=True)
        if card.nvml_index in by_nvml and any(pid != me for pid in card.processes)
    )
