"""Checking one GPU-quirk row (quirk_rows.py) against the facts of one run (`check_match`), and reading
the machine's facts that rows need besides the cards (`read_platform`); quirks.py makes the plan."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import platform
import re
import sys
from collections.abc import Callable, Iterable, Mapping

from levers9.distributed.hardware import cards as _cards
from levers9.distributed.hardware.cards import Card, Inventory
from levers9.distributed.hardware.nccl import NcclInfo, nccl_info
from levers9.distributed.hardware.quirk_rows import Match, NcclKernels

_MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What one check decided: the condition holds (True), does not (False) or cannot be told (None), and why."""

    holds: bool | None
    text: str = ""  # what was seen when it holds; the failing condition or the missing fact otherwise


@dataclasses.dataclass
class Facts:
    """What rows are checked against; each fact of the machine is read only when a row first needs it, unless
    the caller gave it (`inv` / `cards`, `nccl_given`, `platform_given`: tests and `levers9 doctor`)."""

    local_world_size: int
    backend: str  # lower case
    env: Mapping[str, str]
    inv: Inventory | None = None
    cards: list[Card] | None = None
    nccl_given: NcclInfo | None = None
    platform_given: Platform | None = None

    @functools.cached_property
    def inventory(self) -> Inventory:
        if self.inv is not None:
            return self.inv
        if self.cards is not None:
            return Inventory(cards=tuple(self.cards))
        return _cards.inventory(self.env)

    @functools.cached_property
    def cards_in_use(self) -> tuple[Card, ...]:
        """The cards this node's ranks compute on: local rank i uses card i."""
        cards = self.inventory.cards
        return cards[: self.local_world_size] if self.local_world_size <= len(cards) else cards

    @functools.cached_property
    def nccl(self) -> NcclInfo:
        return self.nccl_given if self.nccl_given is not None else nccl_info()

    @functools.cached_property
    def platform(self) -> Platform:
        return self.platform_given if self.platform_given is not None else read_platform()


def _ranks_text(lws: int) -> str:
    return f"{lws} rank(s) on this node"


def _check_ranks(m: Match, ctx: Facts) -> Verdict | None:
    lws = ctx.local_world_size
    if lws < m.min_local_world_size:
        return Verdict(False, f"needs at least {m.min_local_world_size} ranks on this node (local_world_size={lws})")
    if m.max_local_world_size is not None and lws > m.max_local_world_size:
        return Verdict(
            False, f"applies to at most {m.max_local_world_size} ranks on this node (local_world_size={lws})"
        )
    depends = m.min_local_world_size > 1 or m.max_local_world_size is not None
    return Verdict(True, _ranks_text(lws) if depends else "")


def _check_backend(m: Match, ctx: Facts) -> Verdict | None:
    if m.backend is None:
        return None
    if m.backend not in ctx.backend:
        return Verdict(False, f"applies to backend {m.backend!r} (this run uses {ctx.backend!r})")
    return Verdict(True)


def _check_env_unset(m: Match, ctx: Facts) -> Verdict | None:
    var = next((v for v in m.env_unset if v in ctx.env), None)
    return None if var is None else Verdict(False, f"{var}={ctx.env[var]} is set")


def _capable(card: Card, m: Match) -> bool | None:
    """Whether the card meets the row's minimum compute capability; None when it cannot be read."""
    if m.min_capability is None:
        return True
    if card.compute_capability is None:
        return None
    return card.compute_capability >= m.min_capability


def _candidate_cards(m: Match, ctx: Facts) -> list[Card]:
    """The cards in use the row's name matches whose capability meets the row's minimum or cannot be read."""
    return [
        c
        for c in ctx.cards_in_use
        if (m.name is None or re.search(m.name, c.name, re.IGNORECASE)) and _capable(c, m) is not False
    ]


def _check_cards(m: Match, ctx: Facts) -> Verdict | None:
    if m.name is None and m.min_capability is None:
        return None
    candidates = _candidate_cards(m, ctx)
    matching = [c for c in candidates if _capable(c, m)]
    if matching:
        return Verdict(True, _card_list(matching))
    if candidates:
        return Verdict(None, f"the compute capability of {_card_list(candidates)} cannot be read")
    what = f"a card named /{m.name}/" if m.name else "a card"
    if m.min_capability:
        what += f" with compute capability >= {_dotted(m.min_capability)}"
    return Verdict(False, f"needs {what} (cards in use: {_card_list(ctx.cards_in_use)})")


def _check_nvlink(m: Match, ctx: Facts) -> Verdict | None:
    if m.nvlink is None:
        return None
    has = ctx.inventory.has_nvlink(ctx.cards_in_use)
    return _check_flag(m.nvlink, has, ("NVLink", "the cards are joined by NVLink"),
                       ("no NVLink between them", "the cards have no NVLink"))  # fmt: skip


def _check_p2p(m: Match, ctx: Facts) -> Verdict | None:
    if m.p2p_reported is None:
        return None
    reported = ctx.inventory.p2p_reported(ctx.cards_in_use)
    return _check_flag(m.p2p_reported, reported, ("driver reports P2P", "the driver reports P2P"),
                       ("driver reports no P2P", "the driver reports no P2P"))  # fmt: skip


def _check_flag(wanted: bool, seen: bool, if_seen: tuple[str, str], if_not_seen: tuple[str, str]) -> Verdict:
    """Holds when `seen` is what the row wants; each text pair is (what was seen when it holds, why it does not)."""
    holding, failing = if_seen if seen else if_not_seen
    return Verdict(True, holding) if seen == wanted else Verdict(False, failing)


def _check_driver(m: Match, ctx: Facts) -> Verdict | None:
    if m.driver_below is None and m.driver_at_least is None:
        return None
    text = ctx.inventory.driver_version
    drv = _version_tuple(text)
    if drv is None:
        return Verdict(None, "the NVIDIA driver version is unknown")
    if m.driver_below is not None and not drv < m.driver_below:
        return Verdict(False, f"driver {text} is not older than {_dotted(m.driver_below)}")
    if m.driver_at_least is not None and not drv >= m.driver_at_least:
        return Verdict(False, f"driver {text} is older than {_dotted(m.driver_at_least)}")
    return Verdict(True, f"driver {text}")


def _check_platform(m: Match, ctx: Facts) -> Verdict | None:
    if m.platform == "wsl2":
        return Verdict(True, "WSL2") if ctx.platform.wsl else Verdict(False, "this is not WSL2")
    if m.platform == "rocm":
        hip = ctx.platform.rocm
        return Verdict(True, f"ROCm (torch.version.hip={hip})") if hip else Verdict(False, "torch is not a ROCm build")
    return None


def _check_shm(m: Match, ctx: Facts) -> Verdict | None:
    if m.shm_below_mib is None:
        return None
    size = ctx.platform.shm_bytes
    limit = m.shm_below_mib * _MIB
    if size is None:
        return Verdict(False, "there is no /dev/shm to measure")
    if size >= limit:
        return Verdict(False, f"/dev/shm is {size_text(size)} (at least {size_text(limit)})")
    return Verdict(True, f"/dev/shm is {size_text(size)}, expected at least {size_text(limit)}")


def _check_kernel_cmdline(m: Match, ctx: Facts) -> Verdict | None:
    if not m.kernel_cmdline_lacks:
        return None
    cmdline = ctx.platform.kernel_cmdline
    if cmdline is None:
        return Verdict(None, "/proc/cmdline cannot be read")
    present = [w for w in m.kernel_cmdline_lacks if w in cmdline.split()]
    if present:
        return Verdict(False, f"the kernel command line has {present[0]}")
    return Verdict(True, f"/proc/cmdline lacks {' '.join(m.kernel_cmdline_lacks)}")


def _check_nccl(m: Match, ctx: Facts) -> Verdict | None:
    if not m.nccl_lacks:
        return None
    archs = "/".join(r.arch for r in m.nccl_lacks)
    cards = _candidate_cards(m, ctx)
    unread = [c for c in cards if c.compute_capability is None]
    relevant = [
        (c, r)
        for c in cards
        if c.compute_capability is not None
        for r in m.nccl_lacks
        if r.low <= c.compute_capability < r.high
    ]
    if not relevant and not unread:
        return Verdict(False, f"no card in use needs {archs} kernels (cards in use: {_card_list(ctx.cards_in_use)})")
    unknown = ""
    for card, rule in relevant:
        info = ctx.nccl  # read only now: no Blackwell card, no NCCL lookup
        ok = _nccl_has_kernels(rule, info)
        if ok is False:
            return Verdict(
                True,
                f"{card.describe()} needs NCCL kernels for {rule.arch}, but this process loads "
                f"{info.describe()}, which has none. Expected NCCL >= {_dotted(rule.min_version)}"
                + (f" or the {' / '.join(rule.good_wheels)} wheel" if rule.good_wheels else ""),
            )
        if ok is None:
            unknown = (
                f"{card.describe()} needs NCCL kernels for {rule.arch}, "
                f"but the NCCL version cannot be read ({info.describe()})"
            )
    if unread:
        return Verdict(
            None, f"the compute capability of {_card_list(unread)} cannot be read, so whether it needs {archs} kernels is unknown"
        )
    if unknown:
        return Verdict(None, unknown)
    return Verdict(False, f"{ctx.nccl.describe()} has kernels for {', '.join(sorted({r.arch for _, r in relevant}))}")


# One check per group of Match fields; a check answers None when the row does not use its fields.
# Cheap facts come first (no hardware read), then the cards (NVML), the platform, and NCCL last: the
# library is looked up only for a row whose other conditions hold.
CHECKS: tuple[Callable[[Match, Facts], Verdict | None], ...] = (
    _check_ranks,
    _check_backend,
    _check_env_unset,
    _check_cards,
    _check_nvlink,
    _check_p2p,
    _check_driver,
    _check_platform,
    _check_shm,
    _check_kernel_cmdline,
    _check_nccl,
)


def check_match(m: Match, ctx: Facts) -> Verdict:
    """The first check that fails or cannot be told, else a holding verdict naming everything seen."""
    seen = []
    for check in CHECKS:
        verdict = check(m, ctx)
        if verdict is None:
            continue
        if not verdict.holds:
            return verdict
        if verdict.text:
            seen.append(verdict.text)
    return Verdict(True, "; ".join(seen) or _ranks_text(ctx.local_world_size))


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


def _card_list(cards: Iterable[Card]) -> str:
    cards = list(cards)
    if not cards:
        return "none"
    names = sorted({c.name for c in cards})
    idx = ",".join(str(c.index) for c in cards)
    return f"card{'s' if len(cards) > 1 else ''} {idx} ({'; '.join(names)})"


def size_text(n: int) -> str:
    """`n` bytes in MiB, or GiB from 1 GiB: how /dev/shm and memory are said."""
    return f"{n / (1024 * _MIB):.1f} GiB" if n >= 1024 * _MIB else f"{n // _MIB} MiB"


@dataclasses.dataclass(frozen=True)
class Platform:
    """The facts about this machine that rows read besides the cards (pass one to plan_quirks in tests)."""

    wsl: bool = False
    rocm: str | None = None  # the HIP version torch was built with
    shm_bytes: int | None = None  # size of /dev/shm; None if there is none
    kernel_cmdline: str | None = None
    docker: bool = False


def is_wsl() -> bool:
    """True under WSL (the kernel release names Microsoft)."""
    return "microsoft" in platform.release().lower()


def rocm_version() -> str | None:
    """The HIP version torch was built with (torch.version.hip), read without importing torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        hip = getattr(getattr(torch, "version", None), "hip", None)
        return str(hip) if hip else None
    return _rocm_from_files()


@functools.lru_cache(maxsize=1)
def _rocm_from_files() -> str | None:
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


def in_docker() -> bool:
    """True inside a Docker container (Docker creates /.dockerenv)."""
    return os.path.exists("/.dockerenv")


def read_platform() -> Platform:
    """Everything `Platform` holds, read from this machine."""
    return Platform(is_wsl(), rocm_version(), shm_bytes(), kernel_cmdline(), in_docker())
