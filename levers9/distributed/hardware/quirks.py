"""Deciding what the GPU-quirk rows (quirk_rows.py) mean for one run, and acting on it once per process.

`plan_quirks` checks every row in force against the facts of one run (ranks on this node, backend,
environment, cards, NCCL, platform) without side effects, and returns one outcome per row;
`apply_quirks` acts on that plan once per process.

Rules every row follows: anything the user set wins (only absent variables are set); a row can be
switched off by its id (argument `disabled=`, or `LEVERS9_DISABLE_QUIRKS="id1,id2"`, or `all`); rows
apply only with more than one rank on this node unless they say otherwise; what was applied is
logged once on rank 0 and shown by `levers9 doctor`. Users add rows with `register_quirk`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from levers9 import runtime
from levers9.distributed.hardware import cards as _cards
from levers9.distributed.hardware.cards import Card, Inventory
from levers9.distributed.hardware.nccl import NcclInfo, nccl_info
from levers9.distributed.hardware.platform import Platform, read_platform
from levers9.distributed.hardware.quirk_rows import QUIRKS, Match, NcclKernels, Quirk
from levers9.errors import ConfigError, QuirkError

log = logging.getLogger("levers9.quirks")

DISABLE_VAR = "LEVERS9_DISABLE_QUIRKS"
_MIB = 1024 * 1024

Status = Literal["applies", "does not apply", "unknown", "disabled"]


# --- the registry -------------------------------------------------------------------------------

# Process-wide, as the environment the rows set is: rows the user registered (register_quirk) beside QUIRKS.
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


# --- checking one row ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What one check decided: the condition holds (True), does not (False) or cannot be told (None), and why."""

    holds: bool | None
    text: str = ""  # what was seen when it holds; the failing condition or the missing fact otherwise


class _Context:
    """What rows are checked against; each fact is read only when a row first needs it."""

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

    @functools.cached_property
    def platform(self) -> Platform:
        return self._platform if self._platform is not None else read_platform()


def _ranks_text(lws: int) -> str:
    return f"{lws} rank(s) on this node"


def _check_ranks(m: Match, ctx: _Context) -> Verdict | None:
    lws = ctx.local_world_size
    if lws < m.min_local_world_size:
        return Verdict(False, f"needs at least {m.min_local_world_size} ranks on this node (local_world_size={lws})")
    if m.max_local_world_size is not None and lws > m.max_local_world_size:
        return Verdict(
            False, f"applies to at most {m.max_local_world_size} ranks on this node (local_world_size={lws})"
        )
    depends = m.min_local_world_size > 1 or m.max_local_world_size is not None
    return Verdict(True, _ranks_text(lws) if depends else "")


def _check_backend(m: Match, ctx: _Context) -> Verdict | None:
    if m.backend is None:
        return None
    if m.backend not in ctx.backend:
        return Verdict(False, f"applies to backend {m.backend!r} (this run uses {ctx.backend!r})")
    return Verdict(True)


def _check_env_unset(m: Match, ctx: _Context) -> Verdict | None:
    for var in m.env_unset:
        if var in ctx.env:
            return Verdict(False, f"{var}={ctx.env[var]} is set")
    return None


def _capable(card: Card, m: Match) -> bool | None:
    """Whether the card meets the row's minimum compute capability; None when it cannot be read."""
    if m.min_capability is None:
        return True
    if card.compute_capability is None:
        return None
    return card.compute_capability >= m.min_capability


def _candidate_cards(m: Match, ctx: _Context) -> list[Card]:
    """The cards in use the row's name matches whose capability meets the row's minimum or cannot be read."""
    return [
        c
        for c in ctx.cards_in_use
        if (m.name is None or re.search(m.name, c.name, re.IGNORECASE)) and _capable(c, m) is not False
    ]


def _check_cards(m: Match, ctx: _Context) -> Verdict | None:
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


def _check_nvlink(m: Match, ctx: _Context) -> Verdict | None:
    if m.nvlink is None:
        return None
    has = ctx.inventory.has_nvlink(ctx.cards_in_use)
    if has != m.nvlink:
        return Verdict(False, "the cards are joined by NVLink" if has else "the cards have no NVLink")
    return Verdict(True, "NVLink" if has else "no NVLink between them")


def _check_p2p(m: Match, ctx: _Context) -> Verdict | None:
    if m.p2p_reported is None:
        return None
    rep = ctx.inventory.p2p_reported(ctx.cards_in_use)
    if rep != m.p2p_reported:
        return Verdict(False, "the driver reports P2P" if rep else "the driver reports no P2P")
    return Verdict(True, "driver reports P2P" if rep else "driver reports no P2P")


def _check_driver(m: Match, ctx: _Context) -> Verdict | None:
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


def _check_platform(m: Match, ctx: _Context) -> Verdict | None:
    if m.platform == "wsl2":
        return Verdict(True, "WSL2") if ctx.platform.wsl else Verdict(False, "this is not WSL2")
    if m.platform == "rocm":
        hip = ctx.platform.rocm
        return Verdict(True, f"ROCm (torch.version.hip={hip})") if hip else Verdict(False, "torch is not a ROCm build")
    return None


def _check_shm(m: Match, ctx: _Context) -> Verdict | None:
    if m.shm_below_mib is None:
        return None
    size = ctx.platform.shm_bytes
    limit = m.shm_below_mib * _MIB
    if size is None:
        return Verdict(False, "there is no /dev/shm to measure")
    if size >= limit:
        return Verdict(False, f"/dev/shm is {_size(size)} (at least {_size(limit)})")
    return Verdict(True, f"/dev/shm is {_size(size)}, expected at least {_size(limit)}")


def _check_kernel_cmdline(m: Match, ctx: _Context) -> Verdict | None:
    if not m.kernel_cmdline_lacks:
        return None
    cmdline = ctx.platform.kernel_cmdline
    if cmdline is None:
        return Verdict(None, "/proc/cmdline cannot be read")
    present = [w for w in m.kernel_cmdline_lacks if w in cmdline.split()]
    if present:
        return Verdict(False, f"the kernel command line has {present[0]}")
    return Verdict(True, f"/proc/cmdline lacks {' '.join(m.kernel_cmdline_lacks)}")


def _check_nccl(m: Match, ctx: _Context) -> Verdict | None:
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
CHECKS: tuple[Callable[[Match, _Context], Verdict | None], ...] = (
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


def _check_match(m: Match, ctx: _Context) -> Verdict:
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


def _size(n: int) -> str:
    return f"{n / (1024 * _MIB):.1f} GiB" if n >= 1024 * _MIB else f"{n // _MIB} MiB"


# --- the plan -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QuirkOutcome:
    """What one row decided for one plan (doctor shows these)."""

    quirk: Quirk
    status: Status
    detail: str  # what matched, or the first condition that did not
    set_env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # set by this row
    kept: Mapping[str, str] = dataclasses.field(default_factory=dict)  # already set by the user, left alone
    message: str = ""  # the error / warning / applied sentence when it applies

    def says(self, action: str) -> bool:
        """True when the row applies and its action is `action`."""
        return self.status == "applies" and self.quirk.action == action


@dataclasses.dataclass(frozen=True)
class QuirkPlan:
    """What the registry decided for one run: one outcome per row; the rest is derived from them."""

    outcomes: tuple[QuirkOutcome, ...] = ()

    @property
    def set_env(self) -> dict[str, str]:
        """The defaults to set: every applying row's variables, the first row to name one winning."""
        env: dict[str, str] = {}
        for o in self.outcomes:
            for key, value in o.set_env.items():
                env.setdefault(key, value)
        return env

    @property
    def errors(self) -> list[str]:
        """The messages of applying "error" rows."""
        return [o.message for o in self.outcomes if o.says("error")]

    @property
    def warnings(self) -> list[str]:
        """The messages of applying "warning" rows, and a line for each error or warning row that could not be checked."""
        out = []
        for o in self.outcomes:
            if o.says("warning"):
                out.append(o.message)
            elif o.status == "unknown" and o.quirk.action in ("error", "warning"):
                out.append(f"[{o.quirk.id}] could not be checked: {o.detail}. {o.quirk.description}")
        return out

    @property
    def applied(self) -> list[tuple[str, str]]:
        """(id, sentence) of each "set-env" row that set something."""
        return [(o.quirk.id, o.message) for o in self.outcomes if o.says("set-env") and o.set_env]

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
        for o in self.outcomes:
            if o.says("set-env") and o.kept and not o.set_env:
                log.debug("%s", o.message)


def check_quirk_ids(ids: Iterable[str], *, source: str = "disable_quirks=") -> None:
    """Raise ConfigError naming every id in `ids` that is neither a row in force nor "all", with the known ids."""
    if isinstance(ids, str):
        raise ConfigError(f"{source}{ids!r} is one string; expected a tuple of quirk ids, e.g. ({ids!r},).")
    known = [q.id for q in all_quirks()]
    unknown = sorted(set(ids) - set(known) - {"all"})
    if unknown:
        raise ConfigError(
            f"{source} names unknown quirk id(s) {', '.join(map(repr, unknown))}; expected ids of rows in force "
            f"or 'all'. Known ids: {', '.join(known)}. Fix the spelling or drop the id "
            "(`levers9 doctor` lists every row with its id)."
        )


def disabled_ids(disabled: Iterable[str] = (), env: Mapping[str, str] | None = None) -> set[str]:
    """The ids switched off by the argument plus LEVERS9_DISABLE_QUIRKS (comma-separated; 'all' for every row).

    Raises ConfigError for an id that names no row, saying whether the argument or the variable has it.
    """
    env = os.environ if env is None else env
    from_arg = {d.strip() for d in disabled if d and d.strip()}
    from_env = {d.strip() for d in env.get(DISABLE_VAR, "").split(",") if d.strip()}
    check_quirk_ids(from_arg, source="disable_quirks= (disabled=)")
    check_quirk_ids(from_env, source=f"{DISABLE_VAR}={env.get(DISABLE_VAR, '')!r}")
    return from_arg | from_env


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
    Raises ConfigError when `disabled` or LEVERS9_DISABLE_QUIRKS names an unknown id.
    """
    env = os.environ if env is None else env
    off = disabled_ids(disabled, env)
    ctx = _Context(local_world_size, backend, env, inventory, cards, nccl, platform)
    outcomes = []
    for q in all_quirks():
        if q.id in off or "all" in off:
            outcomes.append(QuirkOutcome(q, "disabled", f"switched off ({DISABLE_VAR} or disabled=)"))
            continue
        verdict = _check_match(q.match, ctx)
        if verdict.holds is None:
            outcomes.append(QuirkOutcome(q, "unknown", verdict.text))
        elif not verdict.holds:
            outcomes.append(QuirkOutcome(q, "does not apply", verdict.text))
        else:
            outcomes.append(_applying(q, verdict.text, env))
    return QuirkPlan(tuple(outcomes))


def _applying(q: Quirk, detail: str, env: Mapping[str, str]) -> QuirkOutcome:
    """The outcome of a row that applies: its sentence, and for "set-env" what it sets and what it leaves."""
    evidence = f" Evidence: {', '.join(q.evidence)}." if q.evidence else ""
    off = f" (switch off: {DISABLE_VAR}={q.id})"
    if q.action == "error":
        return QuirkOutcome(q, "applies", detail, message=f"[{q.id}] {q.description} Seen: {detail}. Fix: {q.fix}{evidence}{off}")
    if q.action == "warning":
        return QuirkOutcome(q, "applies", detail, message=f"[{q.id}] {q.description} Seen: {detail}. {q.fix}{evidence}{off}")
    if q.action == "info":
        return QuirkOutcome(q, "applies", detail, message=q.description)
    setting = {k: v for k, v in q.set_env.items() if k not in env}
    kept = {k: env[k] for k in q.set_env if k in env}
    kept_text = ", ".join(f"{k}={v}" for k, v in kept.items())
    if setting:
        what = " ".join(f"{k}={v}" for k, v in setting.items())
        message = (
            f"[{q.id}] set {what}{f' (left {kept_text} as you set it)' if kept else ''}: "
            f"{q.description} Seen: {detail}. {q.fix}{evidence}{off}"
        )
    else:
        message = f"[{q.id}] left {kept_text} as you set it ({q.description})"
    return QuirkOutcome(q, "applies", detail, set_env=setting, kept=kept, message=message)


# --- acting on it -------------------------------------------------------------------------------

_apply_lock = threading.Lock()


def applied_plan() -> QuirkPlan | None:
    """The plan applied for this process (a job process applies its cards' plan before the job's function
    runs; a rank's parent applied it before starting the rank), or None."""
    return runtime.this_process().quirks


def apply_quirks(
    *, local_world_size: int, backend: str, is_main: bool, disabled: Iterable[str] = ()
) -> QuirkPlan:
    """Plan against os.environ, raise QuirkError for errors, setdefault each variable, log on the main rank.

    Once per process: later calls return the first plan. A no-op when the quirks were already applied
    for this process (a rank of distributed.run begins with the plan its parent applied: runtime.py).
    """
    with _apply_lock:
        applied = runtime.this_process().quirks
        if applied is not None:
            return applied
        plan = plan_quirks(local_world_size=local_world_size, backend=backend, disabled=disabled)
        plan.raise_errors()
        for key, value in plan.set_env.items():
            os.environ.setdefault(key, value)
        if is_main:
            plan.log()
        runtime.this_process().quirks = plan
        return plan
