"""Deciding what the GPU-quirk rows (quirk_rows.py) mean for one run, and acting on it once per process.

`plan_quirks` checks every row in force against one run's facts without side effects. `plan_for_world`
is called where a run's world is decided (a job process on its cards, `distributed.run` on each of its
paths, the helpers' group under a launcher); the caller applies the plan here (`apply_quirks`) or hands
its variables to the ranks it starts (`QuirkPlan.set_env`).

Rules every row follows: anything the user set wins (only absent variables are set); a row can be
switched off by its id (argument `disabled=`, or `LEVERS9_DISABLE_QUIRKS="id1,id2"`, or `all`); rows
apply only with more than one rank on this node unless they say otherwise; what was applied is
logged once on rank 0 and shown by `levers9 doctor`. Users add rows with `register_quirk`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping

from levers9 import runtime
from levers9.distributed.hardware.cards import Card, Inventory
from levers9.distributed.hardware.nccl import NcclInfo
from levers9.distributed.hardware.quirk_checks import Facts, Platform, check_match
from levers9.distributed.hardware.quirk_rows import QUIRKS, Quirk, QuirkOutcome, QuirkPlan, Status
from levers9.errors import ConfigError

log = logging.getLogger("levers9.quirks")

DISABLE_VAR = "LEVERS9_DISABLE_QUIRKS"

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
    facts = Facts(local_world_size, backend.lower(), env, inventory, cards, nccl, platform)
    outcomes = []
    for q in all_quirks():
        if q.id in off or "all" in off:
            outcomes.append(QuirkOutcome(q, "disabled", f"switched off ({DISABLE_VAR} or disabled=)"))
            continue
        verdict = check_match(q.match, facts)
        if verdict.holds:
            outcomes.append(_applying(q, verdict.text, env))
        else:
            status: Status = "unknown" if verdict.holds is None else "does not apply"
            outcomes.append(QuirkOutcome(q, status, verdict.text))
    return QuirkPlan(tuple(outcomes))


def _applying(q: Quirk, detail: str, env: Mapping[str, str]) -> QuirkOutcome:
    """The outcome of a row that applies: its sentence, and for "set-env" what it sets and what it leaves."""
    evidence = f" Evidence: {', '.join(q.evidence)}." if q.evidence else ""
    off = f" (switch off: {DISABLE_VAR}={q.id})"
    if q.action in ("error", "warning"):
        fix = f"Fix: {q.fix}" if q.action == "error" else q.fix
        message = f"[{q.id}] {q.description} Seen: {detail}. {fix}{evidence}{off}"
        return QuirkOutcome(q, "applies", detail, message=message)
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


_apply_lock = threading.Lock()


def quirks_applied() -> bool:
    """True when the quirks were already applied for this process: here (a job process applies its cards'
    plan before the job's function runs), or by the parent that started this rank (runtime.py)."""
    this = runtime.this_process()
    return this.quirks is not None or this.quirks_from_parent


def plan_for_world(
    *, local_world_size: int, backend: str, is_main: bool = True, disabled: Iterable[str] = ()
) -> QuirkPlan | None:
    """The plan for the world the caller decided (`local_world_size` ranks on this node, `backend`), against
    os.environ: QuirkError for an error row, what applies logged when `is_main`. None when the quirks were
    already applied for this process, so nothing is planned twice. ConfigError for an unknown id in `disabled`."""
    if quirks_applied():
        return None
    plan = plan_quirks(local_world_size=local_world_size, backend=backend, disabled=disabled)
    plan.raise_errors()
    if is_main:
        plan.log()
    return plan


def apply_quirks(
    *, local_world_size: int, backend: str, is_main: bool, disabled: Iterable[str] = ()
) -> QuirkPlan:
    """The plan for this world (`plan_for_world`), applied in this process: each variable set where absent.

    Once per process: later calls return the first plan; where the parent that started this rank applied
    them, the empty plan (nothing was applied here).
    """
    with _apply_lock:
        plan = plan_for_world(local_world_size=local_world_size, backend=backend, is_main=is_main, disabled=disabled)
        if plan is None:
            return runtime.this_process().quirks or QuirkPlan()
        for key, value in plan.set_env.items():
            os.environ.setdefault(key, value)
        runtime.this_process().quirks = plan
        return plan
