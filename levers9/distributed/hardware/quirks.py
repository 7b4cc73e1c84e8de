"""The GPU-quirk registry: known card / NCCL / platform problems, one row of data each.

A row says what it matches (card name, compute capability, ranks on this node, NVLink, driver, NCCL
build, platform, /dev/shm size, unset variables), what it does (set environment defaults, raise, warn,
or only inform), and the public evidence behind it (owner/repo#N). `plan_quirks` decides, without side
effects, what the rows mean for one run; `apply_quirks` acts on that plan once per process.

Rules every row follows: anything the user set wins (only absent variables are set); a row can be
switched off by its id (argument `disabled=`, or `LEVERS9_DISABLE_QUIRKS="id1,id2"`, or `all`); rows
apply only with more than one rank on this node unless they say otherwise; what was applied is
logged once on rank 0 and shown by `levers9 doctor`. Users add rows with `register_quirk`.

Facts and sources: ../shared/facts/gpu-quirks.md (sections named in each row's notes).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from levers9.distributed.hardware import cards as _cards
from levers9.distributed.hardware.cards import Card, Inventory
from levers9.distributed.hardware.nccl import NcclInfo, nccl_info
from levers9.errors import QuirkError

log = logging.getLogger("levers9.quirks")

Action = Literal["set-env", "error", "warning", "info"]
DISABLE_VAR = "LEVERS9_DISABLE_QUIRKS"
APPLIED_MARKER = "LEVERS9_QUIRKS_APPLIED"  # set by the spawner for its ranks: the parent already applied
_MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class NcclKernels:
    """Which NCCL builds carry device code for cards with compute capability in [low, high)."""

    arch: str  # "sm_120"
    low: tuple[int, int]
    high: tuple[int, int]
    min_version: tuple[int, int, int]  # every build at or above this has the kernels
    min_version_cuda_12_8: tuple[int, int, int]  # a build made with CUDA >= 12.8 has them from here on
    good_wheels: tuple[str, ...]  # PyPI wheels below min_version that have them (the .post1 rebuilds)


@dataclasses.dataclass(frozen=True)
class Match:
    """What a row matches; every field that is set must hold. Card fields look at the cards in use."""

    name: str | None = None  # regex searched (case-insensitive) in the NVML name of a card in use
    min_capability: tuple[int, int] | None = None  # that card's compute capability at least this
    min_local_world_size: int = 2  # ranks on this node
    max_local_world_size: int | None = None
    backend: str | None = "nccl"  # the backend must include this; None matches any backend
    nvlink: bool | None = None  # NVLink joins the cards in use (True) / does not (False)
    p2p_reported: bool | None = None  # the driver reports P2P between the cards in use
    driver_below: tuple[int, ...] | None = None  # NVIDIA driver version lower than this
    driver_at_least: tuple[int, ...] | None = None
    platform: Literal["wsl2", "rocm"] | None = None
    shm_below_mib: int | None = None  # /dev/shm smaller than this
    env_unset: tuple[str, ...] = ()  # these variables are all absent
    kernel_cmdline_lacks: tuple[str, ...] = ()  # none of these words is on /proc/cmdline
    nccl_lacks: tuple[NcclKernels, ...] = ()  # the NCCL in use lacks kernels for a card in use


@dataclasses.dataclass(frozen=True)
class Quirk:
    """One row of the registry."""

    id: str  # stable; what LEVERS9_DISABLE_QUIRKS names
    description: str  # what goes wrong, for the user
    match: Match
    action: Action
    set_env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # for action "set-env"
    fix: str = ""  # what the user can do about it (the real fix, or the command)
    evidence: tuple[str, ...] = ()  # owner/repo#N, docs URLs
    notes: str = ""  # why the row is what it is (thresholds, choices), for readers and doctor


@dataclasses.dataclass(frozen=True)
class Platform:
    """The facts about this machine that rows read besides the cards (pass one to plan_quirks in tests)."""

    wsl: bool = False
    rocm: str | None = None  # the HIP version torch was built with
    shm_bytes: int | None = None  # size of /dev/shm; None if there is none
    kernel_cmdline: str | None = None
    docker: bool = False


@dataclasses.dataclass(frozen=True)
class QuirkOutcome:
    """What one row decided for one plan (doctor shows these)."""

    quirk: Quirk
    status: Literal["applies", "does not apply", "unknown", "disabled"]
    detail: str  # what matched, or the first condition that did not
    set_env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # set by this row
    kept: Mapping[str, str] = dataclasses.field(default_factory=dict)  # already set by the user, left alone
    message: str = ""  # the error / warning / applied sentence when it applies


@dataclasses.dataclass
class QuirkPlan:
    """What the registry decided for one run: defaults to set, errors to raise, things to say."""

    set_env: dict[str, str] = dataclasses.field(default_factory=dict)
    errors: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    applied: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    outcomes: list[QuirkOutcome] = dataclasses.field(default_factory=list)

    def raise_errors(self) -> None:
        """Raise QuirkError with every error message, if there are any."""
        if self.errors:
            raise QuirkError("\n\n".join(self.errors))

    def log(self) -> None:
        """One WARNING line per quirk that set something and per warning, on levers9.quirks: a changed NCCL
        setting is something a user must hear about without configuring logging."""
        for _, sentence in self.applied:
            log.warning("%s", sentence)
        for warning in self.warnings:
            log.warning("%s", warning)


# --- the rows ----------------------------------------------------------------------------------

# Blackwell kernels in NCCL (facts section 1). The seed says "NCCL before 2.26", but the PyPI wheel
# nvidia-nccl-cu12==2.26.2 (what torch 2.7 pins) was built with CUDA 12.2 and has no sm_100/sm_120
# code, while 2.26.2.post1 is the same source rebuilt with CUDA 12.8. sm_120 also needs the
# shared-memory fix of 2.26.2, so 2.25.1(.post1) is fine on B200 but not on RTX 50xx / RTX PRO 6000.
# From 2.26.5 on every PyPI build has both; nvidia-nccl-cu13 starts at 2.27.7.
SM_100 = NcclKernels("sm_100", (10, 0), (12, 0), (2, 26, 5), (2, 25, 1), ("2.25.1.post1", "2.26.2.post1"))
SM_120 = NcclKernels("sm_120", (12, 0), (99, 0), (2, 26, 5), (2, 26, 2), ("2.26.2.post1",))

_P2P_ROOT_CAUSE = (
    "The usual root cause is the IOMMU or PCIe ACS redirecting peer traffic; the real fix is `iommu=pt` "
    "on the kernel command line, or VT-d/IOMMU and ACS off in the BIOS. Then set NCCL_P2P_DISABLE=0 to "
    "get P2P back (levers9 leaves a variable you set alone)."
)

QUIRKS: tuple[Quirk, ...] = (
    Quirk(
        id="blackwell-nccl-kernels",
        description=(
            "NCCL without kernels for Blackwell cards: the first collective fails with "
            "\"Cuda failure 1 'invalid argument'\" (or hangs) after the rings connect."
        ),
        match=Match(min_local_world_size=1, nccl_lacks=(SM_100, SM_120)),
        action="error",
        fix=(
            'pip install -U "nvidia-nccl-cu12>=2.26.5" (pip warns that torch 2.7 pins nvidia-nccl-cu12==2.26.2; '
            'torch loads the newer library anyway), or upgrade torch: pip install -U "torch>=2.8" (pins NCCL '
            "2.27.3). A CUDA 11 build of torch has no Blackwell NCCL at all: install a CUDA 12.8+ build of torch."
        ),
        evidence=(
            "NVIDIA/nccl v2.25.1-1 and v2.26.2-1 release notes",
            "NVIDIA/nccl-tests#287",
            "NVIDIA/nccl-tests#291",
            "NVIDIA/nccl#1637",
            "pytorch/pytorch#151002",
            "vllm-project/vllm#20862",
        ),
        notes=(
            "Threshold: sm_120 passes with NCCL >= 2.26.5, the 2.26.2.post1 wheel, or any build made with CUDA "
            ">= 12.8 from 2.26.2 on; sm_100 with >= 2.26.5, the 2.25.1.post1 / 2.26.2.post1 wheels, or a CUDA "
            ">= 12.8 build from 2.25.1 on. Not the seed's 'before 2.26': the 2.26.2 PyPI wheel (torch 2.7's pin) "
            "was built with CUDA 12.2 and has no Blackwell code (facts 1.3). The version comes from "
            "ncclGetVersion of the library actually loaded, not torch.cuda.nccl.version() (compile-time)."
        ),
    ),
    Quirk(
        id="rtxpro6000-p2p",
        description=(
            "RTX PRO 6000 Blackwell cards without NVLink: the driver reports PCIe P2P as working, yet "
            "NCCL's first all_reduce can hang (and wedge the cards until a reset) on hosts with IOMMU/ACS on."
        ),
        match=Match(name=r"RTX PRO 6000", min_capability=(12, 0), nvlink=False),
        action="set-env",
        set_env={"NCCL_P2P_DISABLE": "1"},
        fix=_P2P_ROOT_CAUSE
        + " Cost: collectives go through shared memory (roughly 25-50% less bus bandwidth).",
        evidence=(
            "NVIDIA/nccl#1999",
            "local-inference-lab/rtx6kpro#15",
            "vllm-project/vllm#33041",
            "NVIDIA/cuda-samples#390",
            "NVIDIA/nccl#2079",
        ),
    ),
    Quirk(
        id="geforce-p2p-old-driver",
        description=(
            "GeForce RTX 40/50 cards on a driver older than 550.40.07: the driver reports P2P that the cards "
            "do not have, and all_reduce hangs at ~99% GPU use."
        ),
        match=Match(name=r"GeForce RTX (40|50)\d\d", driver_below=(550, 40, 7)),
        action="set-env",
        set_env={"NCCL_P2P_DISABLE": "1"},
        fix="Upgrade the NVIDIA driver to 550.40.07 or newer (it reports no P2P and NCCL uses shared memory).",
        evidence=("NVIDIA/nccl-tests#117", "huggingface/accelerate#2195", "huggingface/accelerate#2558"),
        notes="accelerate's rule (RTX 40 + driver < 550.40.07), extended to RTX 50 (same GeForce policy).",
    ),
    Quirk(
        id="geforce-p2p-patched",
        description=(
            "The driver reports P2P between GeForce RTX 40/50 cards, which NVIDIA does not support: this "
            "looks like a patched 'p2p' kernel module, which needs `iommu=pt` or gives hangs / NaN results."
        ),
        match=Match(name=r"GeForce RTX (40|50)\d\d", driver_at_least=(550, 40, 7), p2p_reported=True),
        action="warning",
        fix="If collectives hang or results are wrong, set NCCL_P2P_DISABLE=1 or boot with `iommu=pt`.",
        evidence=("NVIDIA/nccl-tests#287", "NVIDIA/nccl#1637", "tinygrad/open-gpu-kernel-modules#18"),
    ),
    Quirk(
        id="ada-p2p",
        description=(
            "Professional Ada cards (RTX 6000 Ada, RTX 5880 Ada, L40S), 2 to 7 on one node: PCIe P2P "
            "deadlocks all_reduce on hosts with ACS on."
        ),
        match=Match(name=r"RTX 6000 Ada|RTX 5880 Ada|\bL40S\b", max_local_world_size=7),
        action="set-env",
        set_env={"NCCL_P2P_DISABLE": "1"},
        fix=_P2P_ROOT_CAUSE,
        evidence=("axolotl-ai-cloud/axolotl#2041", "axolotl-ai-cloud/axolotl#2044", "NVIDIA/nccl#2079"),
        notes="axolotl's historical rule (1 < n < 8); `levers9 doctor --probe` tests P2P for real.",
    ),
    Quirk(
        id="shm-too-small",
        description=(
            "/dev/shm is smaller than 1 GiB (Docker's default is 64 MiB): NCCL fails to create its "
            'shared-memory segments ("Error while creating shared memory segment", or SIGBUS).'
        ),
        match=Match(shm_below_mib=1024, env_unset=("NCCL_SHM_DISABLE",)),
        action="error",
        fix=(
            "docker run --shm-size=1g --ulimit memlock=-1 ... ; on Kubernetes mount an emptyDir with "
            "`medium: Memory` at /dev/shm; or set NCCL_SHM_DISABLE=1 (slower: NCCL falls back to sockets)."
        ),
        evidence=(
            "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting.html",
            "NVIDIA/nccl#290",
            "NVIDIA/nccl#342",
            "pytorch/torchtitan#853",
            "NVIDIA/JAX-Toolbox#183",
        ),
    ),
    Quirk(
        id="wsl2-p2p",
        description="WSL2 with more than one card: P2P between cards does not work reliably under WSL2.",
        match=Match(platform="wsl2"),
        action="set-env",
        set_env={"NCCL_P2P_DISABLE": "1"},
        fix=(
            "If NCCL then fails creating /dev/shm segments, set NCCL_SHM_DISABLE=1 (slow socket transport); "
            "multi-card training is more reliable on native Linux."
        ),
        evidence=("microsoft/WSL#12467", "NVIDIA/nccl#442", "NVIDIA/nccl#511", "pytorch/pytorch#152302"),
    ),
    Quirk(
        id="rocm-fine-grain-pcie",
        description="AMD ROCm cards on PCIe: RCCL warns of low performance or hangs without fine-grained PCIe memory.",
        match=Match(platform="rocm"),
        action="set-env",
        set_env={"HSA_FORCE_FINE_GRAIN_PCIE": "1"},
        fix="If collectives still hang, set NCCL_P2P_DISABLE=1 (RCCL reads the same variables).",
        evidence=("RCCL src/init.cc", "ROCm/rccl#1129", "ROCm/vllm#390"),
    ),
    Quirk(
        id="rocm-iommu-pt",
        description="AMD ROCm with more than one card and no `iommu=pt` on the kernel command line: RCCL can hang.",
        match=Match(platform="rocm", kernel_cmdline_lacks=("iommu=pt",)),
        action="warning",
        fix="Add iommu=pt to GRUB_CMDLINE_LINUX in /etc/default/grub, run update-grub and reboot.",
        evidence=("RCCL src/init.cc", "ROCm install FAQ, Issue #5", "ROCm/vllm#390"),
    ),
    Quirk(
        id="finite-init-timeout",
        description=(
            "levers9 passes a finite timeout to init_process_group (distributed.run's timeout=, else "
            "LEVERS9_PG_TIMEOUT seconds, else 600 s), so a hung first collective ends in an error naming the "
            "rank; it leaves TORCH_NCCL_ASYNC_ERROR_HANDLING at torch's default (3) and does not set "
            "TORCH_NCCL_BLOCKING_WAIT."
        ),
        match=Match(min_local_world_size=1, backend=None),
        action="info",
        fix="For a quicker verdict on a suspected hang, run `levers9 doctor --probe` (60 s per attempt).",
        evidence=("pytorch docs torch_nccl_environment_variables.rst", "pytorch ProcessGroupNCCL.hpp"),
    ),
)

_user_rows: dict[str, Quirk] = {}
_registry_lock = threading.Lock()


def register_quirk(q: Quirk) -> None:
    """Add a row to the registry; a row with an existing id (built-in or not) replaces that row."""
    if not isinstance(q, Quirk) or not q.id or "," in q.id:
        raise TypeError(f"register_quirk needs a Quirk with an id without commas; got {q!r}.")
    with _registry_lock:
        _user_rows[q.id] = q


def unregister_quirk(quirk_id: str) -> None:
    """Remove a row added with register_quirk (a replaced built-in row comes back); unknown ids are ignored."""
    with _registry_lock:
        _user_rows.pop(quirk_id, None)


def all_quirks() -> tuple[Quirk, ...]:
    """The rows in force: built-in rows (replaced where a user row has the same id), then user rows."""
    with _registry_lock:
        user = dict(_user_rows)
    rows = [user.pop(q.id, q) for q in QUIRKS]
    return (*rows, *user.values())


# --- reading the machine -------------------------------------------------------------------------


def is_wsl() -> bool:
    """True under WSL (the kernel release names Microsoft)."""
    try:
        return "microsoft" in os.uname().release.lower()
    except AttributeError:
        return False


def rocm_version() -> str | None:
    """The HIP version torch was built with (torch.version.hip), read without importing torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        hip = getattr(getattr(torch, "version", None), "hip", None)
        return str(hip) if hip else None
    return _rocm_from_files()


@functools.lru_cache(maxsize=1)
def _rocm_from_files() -> str | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            with open(os.path.join(folder, "version.py"), encoding="utf-8") as f:
                m = re.search(r"^hip\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)['\"]", f.read(), re.MULTILINE)
        except OSError:
            continue
        return m.group(1) if m else None
    return None


def shm_bytes(path: str = "/dev/shm") -> int | None:
    """Total size of the filesystem at `path` (/dev/shm), or None where there is none."""
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return st.f_frsize * st.f_blocks


def kernel_cmdline() -> str | None:
    """/proc/cmdline, or None where it cannot be read."""
    try:
        with open("/proc/cmdline", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def read_platform() -> Platform:
    """Everything `Platform` holds, read from this machine."""
    return Platform(is_wsl(), rocm_version(), shm_bytes(), kernel_cmdline(), os.path.exists("/.dockerenv"))


# --- deciding -------------------------------------------------------------------------------------


class _Context:
    """What rows are matched against; each fact is read only when a row first needs it."""

    def __init__(
        self,
        local_world_size: int,
        backend: str,
        env: Mapping[str, str],
        inv: Inventory | None,
        cards: list[Card] | None,
        nccl: NcclInfo | None,
        platform: Platform | None,
    ) -> None:
        self.local_world_size = local_world_size
        self.backend = backend.lower()
        self.env = env
        self._inv = inv
        self._cards = cards
        self._nccl = nccl
        self._platform = platform

    @functools.cached_property
    def inventory(self) -> Inventory:
        if self._inv is not None:
            return self._inv
        if self._cards is not None:
            return Inventory(cards=tuple(self._cards))
        return _cards.inventory(self.env)

    @functools.cached_property
    def cards_in_use(self) -> tuple[Card, ...]:
        """The cards this node's ranks compute on: local rank i uses card i."""
        cards = self.inventory.cards
        return cards[: self.local_world_size] if self.local_world_size <= len(cards) else cards

    @functools.cached_property
    def nccl(self) -> NcclInfo:
        return self._nccl if self._nccl is not None else nccl_info()

    def platform_fact(self, name: str) -> object:
        if self._platform is not None:
            return getattr(self._platform, name)
        readers: dict[str, Callable[[], object]] = {
            "wsl": is_wsl,
            "rocm": rocm_version,
            "shm_bytes": shm_bytes,
            "kernel_cmdline": kernel_cmdline,
        }
        return readers[name]()


def _version_tuple(text: str | None) -> tuple[int, ...] | None:
    nums = re.findall(r"\d+", text or "")
    return tuple(int(n) for n in nums) if nums else None


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def _nccl_has_kernels(rule: NcclKernels, info: NcclInfo) -> bool | None:
    """Whether the NCCL described has `rule.arch` kernels; None if its version cannot be read."""
    parsed = _version_tuple(info.wheel_version)
    wheel_base = (parsed + (0, 0, 0))[:3] if parsed else None
    version: tuple[int, ...] | None = info.version
    if version is None:
        if not info.wheel_is_loaded or wheel_base is None:
            return None
        version = wheel_base
    if version >= rule.min_version:
        return True
    if info.build_cuda is not None:
        return info.build_cuda >= (12, 8) and version >= rule.min_version_cuda_12_8
    return info.wheel_is_loaded and info.wheel_version in rule.good_wheels and wheel_base == version


def _check(m: Match, ctx: _Context) -> tuple[bool | None, str]:
    """(True, what matched) / (False, the first condition that does not hold) / (None, what is unknown)."""
    lws = ctx.local_world_size
    if lws < m.min_local_world_size:
        return False, f"needs at least {m.min_local_world_size} ranks on this node (local_world_size={lws})"
    if m.max_local_world_size is not None and lws > m.max_local_world_size:
        return (
            False,
            f"applies to at most {m.max_local_world_size} ranks on this node (local_world_size={lws})",
        )
    if m.backend is not None and m.backend not in ctx.backend:
        return False, f"applies to backend {m.backend!r} (this run uses {ctx.backend!r})"
    for var in m.env_unset:
        if var in ctx.env:
            return False, f"{var}={ctx.env[var]} is set"
    seen: list[str] = [f"{lws} rank(s) on this node"]
    cards = list(ctx.cards_in_use)
    if m.name is not None or m.min_capability is not None:
        cards = [
            c
            for c in cards
            if (m.name is None or re.search(m.name, c.name, re.IGNORECASE))
            and (m.min_capability is None or c.compute_capability >= m.min_capability)
        ]
        if not cards:
            what = f"a card named /{m.name}/" if m.name else "a card"
            if m.min_capability:
                what += f" with compute capability >= {_dotted(m.min_capability)}"
            return False, f"needs {what} (cards in use: {_card_list(ctx.cards_in_use)})"
        seen.append(_card_list(cards))
    if m.nvlink is not None:
        has = ctx.inventory.has_nvlink(ctx.cards_in_use)
        if has != m.nvlink:
            return False, "the cards are joined by NVLink" if has else "the cards have no NVLink"
        seen.append("NVLink" if has else "no NVLink between them")
    if m.p2p_reported is not None:
        rep = ctx.inventory.p2p_reported(ctx.cards_in_use)
        if rep != m.p2p_reported:
            return False, "the driver reports P2P" if rep else "the driver reports no P2P"
        seen.append("driver reports P2P" if rep else "driver reports no P2P")
    if m.driver_below is not None or m.driver_at_least is not None:
        drv_text = ctx.inventory.driver_version
        drv = _version_tuple(drv_text)
        if drv is None:
            return None, "the NVIDIA driver version is unknown"
        if m.driver_below is not None and not drv < m.driver_below:
            return False, f"driver {drv_text} is not older than {_dotted(m.driver_below)}"
        if m.driver_at_least is not None and not drv >= m.driver_at_least:
            return False, f"driver {drv_text} is older than {_dotted(m.driver_at_least)}"
        seen.append(f"driver {drv_text}")
    if m.platform == "wsl2":
        if not ctx.platform_fact("wsl"):
            return False, "this is not WSL2"
        seen.append("WSL2")
    elif m.platform == "rocm":
        hip = ctx.platform_fact("rocm")
        if not hip:
            return False, "torch is not a ROCm build"
        seen.append(f"ROCm (torch.version.hip={hip})")
    if m.shm_below_mib is not None:
        size = ctx.platform_fact("shm_bytes")
        if not isinstance(size, int):
            return False, "there is no /dev/shm to measure"
        if size >= m.shm_below_mib * _MIB:
            return False, f"/dev/shm is {_size(size)} (at least {_size(m.shm_below_mib * _MIB)})"
        seen.append(f"/dev/shm is {_size(size)}, expected at least {_size(m.shm_below_mib * _MIB)}")
    if m.kernel_cmdline_lacks:
        cmdline = ctx.platform_fact("kernel_cmdline")
        if not isinstance(cmdline, str):
            return None, "/proc/cmdline cannot be read"
        present = [w for w in m.kernel_cmdline_lacks if w in cmdline.split()]
        if present:
            return False, f"the kernel command line has {present[0]}"
        seen.append(f"/proc/cmdline lacks {' '.join(m.kernel_cmdline_lacks)}")
    if m.nccl_lacks:
        return _check_nccl(m.nccl_lacks, ctx, cards, seen)
    return True, "; ".join(seen)


def _check_nccl(
    rules: tuple[NcclKernels, ...], ctx: _Context, cards: list[Card], seen: list[str]
) -> tuple[bool | None, str]:
    relevant = [(c, r) for c in cards for r in rules if r.low <= c.compute_capability < r.high]
    if not relevant:
        archs = "/".join(r.arch for r in rules)
        return False, f"no card in use needs {archs} kernels (cards in use: {_card_list(ctx.cards_in_use)})"
    info = ctx.nccl  # read only now: no Blackwell card, no NCCL lookup
    unknown = None
    for card, rule in relevant:
        ok = _nccl_has_kernels(rule, info)
        if ok is False:
            return True, (
                f"{card.describe()} needs NCCL kernels for {rule.arch}, but this process loads "
                f"{info.describe()}, which has none. Expected NCCL >= {_dotted(rule.min_version)}"
                + (f" or the {' / '.join(rule.good_wheels)} wheel" if rule.good_wheels else "")
            )
        if ok is None:
            unknown = f"{card.describe()} needs NCCL kernels for {rule.arch}, but the NCCL version cannot be read ({info.describe()})"
    if unknown:
        return None, unknown
    return False, f"{info.describe()} has kernels for {', '.join(sorted({r.arch for _, r in relevant}))}"


def _card_list(cards: Iterable[Card]) -> str:
    cards = list(cards)
    if not cards:
        return "none"
    names = sorted({c.name for c in cards})
    idx = ",".join(str(c.index) for c in cards)
    return f"card{'s' if len(cards) > 1 else ''} {idx} ({'; '.join(names)})"


def _size(n: int) -> str:
    return f"{n / (1024 * _MIB):.1f} GiB" if n >= 1024 * _MIB else f"{n // _MIB} MiB"


def disabled_ids(disabled: Iterable[str] = (), env: Mapping[str, str] | None = None) -> set[str]:
    """The ids switched off by the argument plus LEVERS9_DISABLE_QUIRKS (comma-separated; 'all' for every row)."""
    env = os.environ if env is None else env
    ids = {d.strip() for d in disabled if d and d.strip()}
    ids |= {d.strip() for d in env.get(DISABLE_VAR, "").split(",") if d.strip()}
    return ids


def plan_quirks(
    *,
    local_world_size: int,
    backend: str,
    env: Mapping[str, str] | None = None,
    cards: list[Card] | None = None,
    disabled: Iterable[str] = (),
    inventory: Inventory | None = None,
    nccl: NcclInfo | None = None,
    platform: Platform | None = None,
) -> QuirkPlan:
    """Decide, without side effects, what every row means for a run with these ranks on this node.

    `env` (default os.environ) is what the user set; only variables absent from it go to `set_env`.
    `cards` / `inventory`, `nccl` and `platform` replace what would be read from this machine.
    """
    env = os.environ if env is None else env
    off = disabled_ids(disabled, env)
    ctx = _Context(local_world_size, backend, env, inventory, cards, nccl, platform)
    plan = QuirkPlan()
    rows = all_quirks()
    unknown_ids = off - {q.id for q in rows} - {"all"}
    if unknown_ids:
        plan.warnings.append(
            f"{DISABLE_VAR} / disabled= names unknown quirk id(s) {', '.join(sorted(unknown_ids))}; "
            f"known ids: {', '.join(q.id for q in rows)}."
        )
    for q in rows:
        if q.id in off or "all" in off:
            plan.outcomes.append(QuirkOutcome(q, "disabled", f"switched off ({DISABLE_VAR} or disabled=)"))
            continue
        ok, detail = _check(q.match, ctx)
        if ok is None:
            plan.outcomes.append(QuirkOutcome(q, "unknown", detail))
            if q.action in ("error", "warning"):
                plan.warnings.append(f"[{q.id}] could not be checked: {detail}. {q.description}")
            continue
        if not ok:
            plan.outcomes.append(QuirkOutcome(q, "does not apply", detail))
            continue
        plan.outcomes.append(_act(q, detail, env, plan))
    return plan


def _act(q: Quirk, detail: str, env: Mapping[str, str], plan: QuirkPlan) -> QuirkOutcome:
    evidence = f" Evidence: {', '.join(q.evidence)}." if q.evidence else ""
    off = f" (switch off: {DISABLE_VAR}={q.id})"
    if q.action == "error":
        message = f"[{q.id}] {q.description} Seen: {detail}. Fix: {q.fix}{evidence}{off}"
        plan.errors.append(message)
        return QuirkOutcome(q, "applies", detail, message=message)
    if q.action == "warning":
        message = f"[{q.id}] {q.description} Seen: {detail}. {q.fix}{evidence}{off}"
        plan.warnings.append(message)
        return QuirkOutcome(q, "applies", detail, message=message)
    if q.action == "info":
        return QuirkOutcome(q, "applies", detail, message=q.description)
    setting = {k: v for k, v in q.set_env.items() if k not in env}
    kept = {k: env[k] for k in q.set_env if k in env}
    new = {k: v for k, v in setting.items() if k not in plan.set_env}
    plan.set_env.update(new)
    if setting:
        what = " ".join(f"{k}={v}" for k, v in setting.items())
        kept_text = f" (left {', '.join(f'{k}={v}' for k, v in kept.items())} as you set it)" if kept else ""
        message = f"[{q.id}] set {what}{kept_text}: {q.description} Seen: {detail}. {q.fix}{evidence}{off}"
        plan.applied.append((q.id, message))
    else:
        message = (
            f"[{q.id}] left {', '.join(f'{k}={v}' for k, v in kept.items())} as you set it ({q.description})"
        )
        log.debug("%s", message)
    return QuirkOutcome(q, "applies", detail, set_env=setting, kept=kept, message=message)


_applied: QuirkPlan | None = None
_apply_lock = threading.Lock()


def apply_quirks(
    *, local_world_size: int, backend: str, is_main: bool, disabled: Iterable[str] = ()
) -> QuirkPlan:
    """Plan against os.environ, raise QuirkError for errors, setdefault each variable, log on the main rank.

    Once per process: later calls return the first plan. A no-op (empty plan) when the parent already
    applied the quirks for this process (LEVERS9_QUIRKS_APPLIED=1, set by distributed.run for its ranks).
    """
    global _applied
    with _apply_lock:
        if _applied is not None:
            return _applied
        if os.environ.get(APPLIED_MARKER) == "1":
            _applied = QuirkPlan()
            return _applied
        plan = plan_quirks(local_world_size=local_world_size, backend=backend, disabled=disabled)
        plan.raise_errors()
        for key, value in plan.set_env.items():
            os.environ.setdefault(key, value)
        if is_main:
            plan.log()
        _applied = plan
        return plan
