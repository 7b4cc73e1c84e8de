"""`levers9 run`: torchrun on distributed.run's ranks, on one machine or on each of several.

    levers9 run [--nproc-per-node N|gpu|cpu|auto] [-m | --no-python] SCRIPT_OR_MODULE [args...]
    levers9 run --nnodes 2 --node-rank 0|1 --master-addr HOST --master-port P ... SCRIPT   # on each node

torchrun's spellings are accepted (both `--nproc-per-node` and `--nproc_per_node`), and each option's PET_
variable as torchrun reads it (torchrun_env.py). Across nodes (--nnodes, or srun with one task per node) this
launcher is one node of the run: distributed/torchrun_nodes.py and distributed/slurm_gang.py.
The exit status is torchrun's: 0 when every rank succeeded, 1 when any rank failed (an exception,
sys.exit(N), a signal, a timeout or stall) and when levers9 run itself got SIGTERM or SIGHUP and stopped
every rank (each given its SIGTERM and grace period first), 2 for a bad command line (nothing was
started). `--rank-exit-status` exits with the failing rank's own status instead (N for sys.exit(N),
128+N for signal N, 143 or 129 after SIGTERM or SIGHUP).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from typing import Any

from levers9 import distributed as dist
from levers9 import torchrun_env
from levers9.distributed import script as scripts
from levers9.distributed import slurm_gang, torchrun_nodes
from levers9.errors import ConfigError, LauncherEnvError, RankFailed, signal_name

log = logging.getLogger("levers9.run")

MULTI_NODE_FIX = (
    "With --nnodes 1, levers9 run starts every rank on this machine. To run across several machines, start it on "
    "each node as torchrun: `levers9 run --nnodes 2 --node-rank <i> --master-addr <node 0's address> --master-port "
    "29500 --nproc-per-node 8 train.py` (or --rdzv-backend c10d --rdzv-endpoint HOST:PORT), with the same secret "
    "on every node: `export LEVERS9_GANG_SECRET=$(python -c 'import secrets; print(secrets.token_hex(16))')`; under "
    "SLURM, `srun --ntasks-per-node=1 levers9 run --nproc-per-node 8 train.py` with that secret exported."
)
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "")


def _both(name: str) -> list[str]:
    """A torchrun option in both spellings: --nproc-per-node and --nproc_per_node."""
    spellings = [f"--{name}"]
    if "-" in name:
        spellings.append(f"--{name.replace('-', '_')}")
    return spellings


def register(sub: Any) -> None:
    """Add `levers9 run` to the command line."""
    parser = sub.add_parser(
        "run",
        allow_abbrev=False,
        usage="levers9 run [--nproc-per-node N|gpu|cpu|auto] [-m | --no-python] [options] SCRIPT_OR_MODULE [args ...]",
        help="run a torchrun script on every card of this machine (a drop-in for torchrun --standalone)",
        description=(
            "Run SCRIPT (or -m MODULE) on N ranks of this machine, each as __main__ with torchrun's environment "
            "(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/MASTER_PORT, TORCHELASTIC_*). The first failing rank's "
            "traceback is printed, the other ranks are stopped, and the exit status is torchrun's (1; "
            "--rank-exit-status for the rank's own)."
        ),
        epilog="Example: levers9 run --nproc-per-node 2 train.py --epochs 3",
    )
    same = parser.add_argument_group("torchrun's options (single machine)")
    same.add_argument(*_both("nproc-per-node"), dest="nproc_per_node", metavar="N|gpu|cpu|auto",
                      help="ranks to start (default: one per visible card, else 1)")
    same.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, run as `python -m`")
    same.add_argument(*_both("no-python"), dest="no_python", action="store_true",
                      help="SCRIPT is a program, run without python")
    same.add_argument("--standalone", action="store_true", help="accepted: levers9 run is always standalone")
    same.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                      help="nodes, each running levers9 run (MIN:MAX waits for MAX: levers9 does not resize)")
    same.add_argument(*_both("node-rank"), dest="node_rank", default="0", help="this node's number (static rendezvous)")
    same.add_argument(*_both("master-addr"), dest="master_addr", default=None,
                      help="across nodes: node 0's address (default 127.0.0.1)")
    same.add_argument(*_both("master-port"), dest="master_port", default=None,
                      help="across nodes: node 0's port for levers9's store (default 29500); on one machine "
                           "ignored: the store binds a free loopback port, so nothing collides")
    for name, say in (("rdzv-backend", "static (default) or c10d"), ("rdzv-endpoint", "c10d: HOST[:PORT] of the host"),
                      ("rdzv-id", "the run's id, the same on every node"),
                      ("rdzv-conf", "join_timeout=SECONDS (default 600), is_host=0|1")):  # fmt: skip
        same.add_argument(*_both(name), dest=name.replace("-", "_"), default=None, help=say)
    same.add_argument(*_both("max-restarts"), dest="max_restarts", type=int, default=0,
                      help="start every rank again after a crash, lost peer or stall, up to N times")
    same.add_argument(*_both("start-method"), dest="start_method", choices=("spawn", "fork", "forkserver"),
                      default=None, help="default: fork where safe (fast), fresh interpreters otherwise")
    same.add_argument(*_both("local-ranks-filter"), dest="local_ranks_filter", default="",
                      help="show only these ranks' output on the console, e.g. 0 or 0,2")
    same.add_argument(*_both("log-dir"), dest="log_dir", default=None,
                      help="also write each rank's output to a fresh private folder in LOG_DIR: "
                           "LOG_DIR/levers9-<time>-<random>/<rank>/stdout.log and stderr.log")
    same.add_argument("-r", "--redirects", default="0", help="accepted: the console always keeps every stream")
    same.add_argument("-t", "--tee", default="0", help="accepted: with --log-dir, output is always teed")
    for name in ("monitor-interval", "role"):
        same.add_argument(*_both(name), dest=name.replace("-", "_"), default=None, help="accepted, no effect")
    own = parser.add_argument_group("levers9's own options")
    own.add_argument("--timeout", type=float, metavar="SECONDS", help="stop every rank after this long (exit 1)")
    own.add_argument(
        "--stall-timeout", type=float, metavar="SECONDS",
        help="stop every rank once no collective progressed for this long; report where each rank was",
    )
    own.add_argument("--no-prefix", action="store_true", help="no '[rank N] ' before other ranks' output")
    own.add_argument("--rank-exit-status", action="store_true",
                     help="exit with the failing rank's own status (N for sys.exit(N), 128+N for signal N, 143 after "
                          "SIGTERM to levers9 run) instead of torchrun's 1")
    own.add_argument("--restart-on", default=None, metavar="KINDS",
                     help="what a restart may cure, e.g. crash,comm,lost,stall (the default) or crash,comm,lost,stall,exception")
    own.add_argument("--restart-delay", type=float, default=None, metavar="SECONDS",
                     help="wait this long between attempts (default 1)")
    parser.add_argument("script", metavar="SCRIPT_OR_MODULE", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    parser.set_defaults(handler=main)
    torchrun_env.read_pet_variables(parser, os.environ)  # each torchrun option's PET_ variable, as torchrun reads it


def _refuse_multi_node(args: argparse.Namespace) -> None:
    """ConfigError for every option that asks for more than this machine."""
    if args.nnodes not in ("1", "1:1"):
        raise ConfigError(f"--nnodes {args.nnodes}; expected 1 (or 1:1). {MULTI_NODE_FIX}")
    if str(args.node_rank) != "0":
        raise ConfigError(f"--node-rank {args.node_rank}; expected 0 (one machine). {MULTI_NODE_FIX}")
    endpoint = (args.rdzv_endpoint or "").rsplit(":", 1)[0].strip("[]")
    for flag, host in (("--master-addr", args.master_addr), ("--rdzv-endpoint", endpoint)):
        if host is not None and host not in LOCAL_HOSTS:
            raise ConfigError(f"{flag} names {host!r}, another machine; expected this one (localhost). {MULTI_NODE_FIX}")
    if args.rdzv_backend not in (None, "c10d", "static"):
        raise ConfigError(f"--rdzv-backend {args.rdzv_backend}; expected c10d or static on one machine. {MULTI_NODE_FIX}")


def _console_ranks(text: str) -> tuple[int, ...] | None:
    if not text.strip():
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--local-ranks-filter {text!r}; expected local ranks separated by commas, e.g. 0 or 0,2."
        ) from None


def _slurm_step_across_nodes() -> bool:
    """True when srun started this `levers9 run` as one task on each of several nodes (LauncherEnvError
    when it started several on a node)."""
    if not slurm_gang.check_one_task_per_node(os.environ, "levers9 run"):
        return False
    slurm_gang.not_a_rank()
    return True


def main(args: argparse.Namespace) -> int:
    """Run the script on every rank; the exit status follows torchrun's rules."""
    try:
        torchrun_env.check(args)
        layout = torchrun_nodes.layout_of(args)  # None for one node
        across_nodes = _slurm_step_across_nodes()
        if layout is None and not across_nodes:
            _refuse_multi_node(args)
        if args.master_port is not None and layout is None:
            log.info("--master-port %s ignored: the rendezvous store binds a free loopback port", args.master_port)
        target = scripts.prepare(
            args.script,
            args.script_args,
            module=args.module,
            no_python=args.no_python,
            log_dir=args.log_dir,
            console_ranks=_console_ranks(args.local_ranks_filter),
            what="levers9 run",
        )
        count, backend = scripts.resolve_nprocs(args.nproc_per_node, None, flag="--nproc-per-node")
        target = scripts.with_log_folder(target, "levers9 run")
        scripts.say_one_thread_each(count)
        place = None
        if layout is not None:  # --nnodes N (or PET_NNODES): this launcher is one node of N (torchrun_nodes.py)
            place = torchrun_nodes.join(layout, count)
        elif across_nodes:  # srun with one task per node: this task starts its node's share (slurm_gang.py)
            gang = slurm_gang.gang_of_step(os.environ, count)
            place = torchrun_nodes.NodePlace(gang, slurm_gang.launcher_job(gang))
        call = functools.partial(
            dist.run,
            scripts.run_script_target,
            target,
            nprocs=count if place is None else place.gang.world_size,
            backend=backend,
            timeout=args.timeout,
            stall_timeout=args.stall_timeout,
            start_method="spawn" if args.start_method == "forkserver" else args.start_method,
            prefix_output=not args.no_prefix,
            max_restarts=args.max_restarts,
            restart_on=None if args.restart_on is None else tuple(k.strip() for k in args.restart_on.split(",") if k.strip()),
            restart_delay=args.restart_delay,
            init_group=False,  # the script makes its own group, as under torchrun
        )
        if place is None:
            call()
        else:
            slurm_gang.run_as_node(place.gang, place.job, {}, call, place.server)
    except (ConfigError, LauncherEnvError) as exc:
        if scripts.failure_of(exc) is not None:  # raised on a rank (e.g. init_process_group's world_size)
            return _report_failure(exc)
        print(f"levers9 run: error: {str(exc).removeprefix('levers9 run: ')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("levers9 run: interrupted; every rank was stopped.", file=sys.stderr)
        return 130
    except SystemExit as exc:  # SIGTERM or SIGHUP to this process (see procs.watch.exit_on_terminate)
        if not (isinstance(exc.code, int) and exc.code > 128):
            raise
        print(f"levers9 run: got {signal_name(exc.code - 128)}; every rank was stopped.", file=sys.stderr)
        return exc.code if args.rank_exit_status else 1  # torchrun's agent exits 1 here too
    except BaseException as exc:  # noqa: BLE001 - a rank's failure becomes the exit status
        code = _report_failure(exc)
        return code if args.rank_exit_status else 1
    return 0


ALSO_FAILED = "\nAlso failed, after the root cause:\n"  # where each other failed rank's report begins (root_failure.py)


def _report_failure(exc: BaseException) -> int:
    """Print the failing rank's headline and its own traceback; return that rank's own exit status (1 for an
    exception, N for sys.exit(N), 128+N for signal N)."""
    failure = scripts.failure_of(exc)
    if failure is None:
        if isinstance(exc, RankFailed):  # a timeout or a stall: the report says where every rank was
            print(str(exc).replace("distributed.run", "levers9 run", 1), file=sys.stderr, flush=True)
            return 1
        import traceback  # one rank, run in place: the script's own exception

        print(scripts.user_traceback("".join(traceback.format_exception(exc))), file=sys.stderr)
        return 1
    wrapper = exc if exc.__cause__ is None else exc.__cause__
    headline = str(wrapper).split("\n", 1)[0].replace("distributed.run:", "levers9 run:", 1)
    lines = [headline]
    if failure.traceback:
        lines += ["", f"Traceback from rank {failure.rank}:", scripts.user_traceback(failure.traceback).rstrip()]
    elif "\n" in str(wrapper):
        lines += ["", str(wrapper).split("\n", 1)[1].strip()]
    also = ALSO_FAILED + ALSO_FAILED.join(str(wrapper).split(ALSO_FAILED)[1:])  # each other failed rank's report, once
    if failure.traceback and also != ALSO_FAILED:
        lines += [scripts.user_traceback(also).rstrip()]
    code = scripts.exit_code_for(exc)
    lines += ["", f"levers9 run: rank {failure.rank}'s exit status was {code}."]
    print("\n".join(lines), file=sys.stderr, flush=True)
    return code
