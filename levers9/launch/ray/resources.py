"""`levers9 ray node-args`: the `ray start` arguments that describe this machine's cards to a Ray cluster.

    ray start --head $(levers9 ray node-args --unquoted)
    eval "ray start --address=HEAD:6379 $(levers9 ray node-args)"

Each card type becomes a custom resource, `levers9_<type>` (for example `levers9_RTXPro6000: 4`),
named by the same normalisation the local executor uses (`gpu_types.type_of_card`), because Ray's
own accelerator-type detection turns "NVIDIA RTX PRO 6000 ..." into "RTX". The Ray backend asks for
these resources, so a job for a type lands only on nodes that have it. Nothing here imports Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections import Counter
from collections.abc import Mapping
from typing import Any

from levers9.cli import said_as
from levers9.launch.pool import local_pool

RESOURCE_PREFIX = "levers9_"


def resource_name(gpu_type: str) -> str:
    """The Ray custom resource that stands for one card of `gpu_type`: 'levers9_RTXPro6000'."""
    return RESOURCE_PREFIX + gpu_type


def node_resources(env: Mapping[str, str] | None = None) -> tuple[int, dict[str, float]]:
    """(number of GPUs, custom resources) of this machine: simulated cards when LEVERS9_SIMULATE_GPUS
    is set, else the NVIDIA cards NVML shows this process (honouring CUDA_VISIBLE_DEVICES)."""
    pool = local_pool(env)
    counts = Counter(card.type_name for card in pool.cards)
    return len(pool.cards), {resource_name(t): float(n) for t, n in sorted(counts.items())}


def node_args(env: Mapping[str, str] | None = None, *, quoted: bool = True) -> list[str]:
    """['--num-gpus=4', '--resources={"levers9_RTXPro6000":4}'], shell-quoted when `quoted`."""
    gpus, resources = node_resources(env)
    args = [f"--num-gpus={gpus}"]
    if resources:
        text = json.dumps({k: int(v) for k, v in resources.items()}, separators=(",", ":"))
        args.append(f"--resources={shlex.quote(text) if quoted else text}")
    return args


def register(subparsers: Any) -> None:
    """Add `ray` and its `node-args` subcommand to the levers9 command."""
    parser = subparsers.add_parser("ray", help="run @job functions on a Ray cluster: node set-up")
    parser.set_defaults(handler=lambda args: _usage(parser))
    sub = parser.add_subparsers(dest="ray_command", metavar="COMMAND")
    args = sub.add_parser(
        "node-args",
        help="print the `ray start` arguments for this machine's cards (--num-gpus, --resources)",
        description=(
            "Print the `ray start` arguments that declare this machine's cards, with each card type as "
            "a levers9_<type> resource. Paste them after `ray start`, or use "
            '`eval "ray start --head $(levers9 ray node-args)"`.'
        ),
    )
    style = args.add_mutually_exclusive_group()
    style.add_argument("--json", action="store_true", help='print {"num_gpus": N, "resources": {...}}')
    style.add_argument(
        "--unquoted",
        action="store_true",
        help="no shell quotes, for `ray start --head $(levers9 ray node-args --unquoted)`",
    )
    args.set_defaults(handler=_node_args)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


@said_as("levers9 ray node-args", 1)
def _node_args(args: argparse.Namespace) -> int:
    gpus, resources = node_resources(os.environ)
    if args.json:
        print(json.dumps({"num_gpus": gpus, "resources": {k: int(v) for k, v in resources.items()}}))
    else:
        print(" ".join(node_args(os.environ, quoted=not args.unquoted)))
    if gpus == 0:
        print(
            "levers9 ray node-args: this machine has no NVIDIA card levers9 can see (see `levers9 doctor`); "
            "it can still run CPU jobs. For a test cluster, set LEVERS9_SIMULATE_GPUS='RTXPro6000:4'.",
            file=sys.stderr,
        )
    return 0
