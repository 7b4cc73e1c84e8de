"""`levers9 workspace ...`: show and change the workspace settings (multi-GPU switch, per-job card cap).

levers9 workspace                    # the settings, where they live, and this machine's cards
levers9 workspace show --json
levers9 workspace multi-gpu          # on or off?
levers9 workspace multi-gpu on       # allow gpu_count > 1 from the next call on
levers9 workspace max-gpu-count 4    # the most cards one job may ask for
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from levers9.cli import said_as, whole_number
from levers9.errors import Levers9Error
from levers9.launch.pool import local_pool
from levers9.launch.settings import MAX_GPU_COUNT_LIMIT, Settings, load_settings, update_settings


def register(subparsers: Any) -> None:
    """Add `workspace` and its subcommands to the levers9 command."""
    parser = subparsers.add_parser(
        "workspace", help="show or change the workspace settings (multi-GPU switch, card cap)"
    )
    parser.set_defaults(handler=_show, json=False)
    sub = parser.add_subparsers(dest="workspace_command", metavar="SETTING")
    show = sub.add_parser("show", help="the settings, where they come from, and this machine's cards")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(handler=_show)
    multi = sub.add_parser("multi-gpu", help="read or set the multi-GPU switch (gates gpu_count > 1)")
    multi.add_argument("state", nargs="?", choices=["on", "off"], help="omit to print the current state")
    multi.set_defaults(handler=_multi_gpu)
    cap = sub.add_parser("max-gpu-count", help="read or set the most cards one job may ask for")
    count = whole_number("cards", 1, MAX_GPU_COUNT_LIMIT)
    cap.add_argument("count", nargs="?", type=count, help=f"1 to {MAX_GPU_COUNT_LIMIT}; omit to print it")
    cap.set_defaults(handler=_max_gpu_count)


def _on_off(value: bool) -> str:
    return "on" if value else "off"


def _cards_line() -> str:
    try:
        settings = load_settings()
        return local_pool(simulate=settings.simulate_gpus).describe()
    except Levers9Error as exc:
        return f"unknown ({exc})"


@said_as("levers9", 1)
def _show(args: argparse.Namespace) -> int:
    settings = load_settings()
    source = "" if settings.exists else " (no file yet: the defaults)"
    if args.json:
        print(json.dumps({
            "path": str(settings.path),
            "exists": settings.exists,
            "multi_gpu": settings.multi_gpu,
            "max_gpu_count": settings.max_gpu_count,
            "simulate_gpus": settings.simulate_gpus,
            "cards": _cards_line(),
        }, indent=2))  # fmt: skip
        return 0
    print(f"Workspace settings: {settings.path}{source}")
    print(f"  multi-GPU jobs:  {_on_off(settings.multi_gpu)}    (levers9 workspace multi-gpu on|off)")
    print(f"  max GPU count:   {settings.max_gpu_count} per job    (levers9 workspace max-gpu-count N)")
    if settings.simulate_gpus:
        print(f"  simulated cards: {settings.simulate_gpus}")
    print(f"  this machine:    {_cards_line()}")
    return 0


@said_as("levers9", 1)
def _multi_gpu(args: argparse.Namespace) -> int:
    value = None if args.state is None else args.state == "on"
    return _show_or_set("multi_gpu", value, "Multi-GPU jobs", _on_off, _limit_and_path)


@said_as("levers9", 1)
def _max_gpu_count(args: argparse.Namespace) -> int:
    return _show_or_set("max_gpu_count", args.count, "Max GPU count per job", str, _path_and_switch)


def _limit_and_path(after: Settings) -> str:
    return f"Per-job limit: {after.max_gpu_count} cards (this machine: {_cards_line()}). Saved in {after.path}."


def _path_and_switch(after: Settings) -> str:
    usable = after.multi_gpu or after.max_gpu_count == 1
    return f"Saved in {after.path}." + ("" if usable else " Multi-GPU jobs are off: levers9 workspace multi-gpu on")


def _show_or_set(key: str, value: Any, title: str, say: Callable[[Any], str], tail: Callable[[Settings], str]) -> int:
    """Print setting `key` as `title: VALUE (PATH).` when `value` is None; else save `value` and print the
    new and old values, that it takes effect on the next call, and `tail` of the saved settings."""
    if value is None:
        settings = load_settings()
        print(f"{title}: {say(getattr(settings, key))} ({settings.path}).")
        return 0
    before, after = update_settings(**{key: value})
    print(f"{title}: {say(getattr(after, key))} (was {say(getattr(before, key))}). Takes effect on the next call. "
          f"{tail(after)}")  # fmt: skip
    return 0
