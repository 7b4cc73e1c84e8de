"""`levers9 run`: torchrun on distributed.run's ranks, on one machine or on each of several.

    levers9 run [--nproc-per-node N|gpu|cpu|auto] [-m | --no-python | --run-path] [options] SCRIPT [args...]
    levers9 run --nnodes 2 --node-rank 0|1 --master-addr HOST --master-port P ... SCRIPT   # on each node

Every option of `torchrun --help` is accepted in both spellings (`--nproc-per-node`, `--nproc_per_node`) with
torchrun's meaning (restarts after any failure, its log folder, error files, role and prefixes:
distributed/torchrun_agent.py), or refused, before anything starts, with why it has no meaning here; each option's
PET_ variable is read as torchrun reads it (below). Across nodes (--nnodes, or srun with one task per
node) this launcher is one node of the run: distributed/torchrun_nodes.py and distributed/slurm_gang.py.
The exit status is torchrun's: 0 when every rank succeeded, 1 when any rank failed (an exception,
sys.exit(N), a signal, a timeout or stall) and when levers9 run itself got SIGTERM or SIGHUP (or a signal of
--signals-to-handle) and stopped every rank (each given its SIGTERM and grace period first), 2 for a bad command
line (nothing was started). `--rank-exit-status` exits with the failing rank's own status instead (N for
sys.exit(N), 128+N for signal N, 143 or 129 after SIGTERM or SIGHUP).
"""

from __future__ import annotations

import argparse
import functools
import os
import secrets
import signal
import sys
from collections.abc import Mapping
from typing import Any

from levers9.distributed import script as scripts
from levers9.distributed import slurm_gang, torchrun_agent, torchrun_nodes
from levers9.distributed.detect import LEVERS9_RUN_ID_PREFIX
from levers9.distributed.restarts import LAST_ATTEMPT
from levers9.distributed.running import RunOptions, run_with
from levers9.distributed.started_ranks import STOP_GRACE_S
from levers9.distributed.torchrun_agent import TorchrunAgent
from levers9.errors import ConfigError, LauncherEnvError, RankFailed, signal_name
from levers9.retries import TORCHRUN_RESTART_ON

MULTI_NODE_FIX = (
    "With --nnodes 1, levers9 run starts every rank on this machine. To run across several machines, start it on "
    "each node as torchrun: `levers9 run --nnodes 2 --node-rank <i> --master-addr <node 0's address> --master-port "
    "29500 --nproc-per-node 8 train.py` (or --rdzv-backend c10d --rdzv-endpoint HOST:PORT), with the same secret "
    "on every node: `export LEVERS9_GANG_SECRET=$(python -c 'import secrets; print(secrets.token_hex(16))')`; under "
    "SLURM, `srun --ntasks-per-node=1 levers9 run --nproc-per-node 8 train.py` with that secret exported."
)
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "")
HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's default --signals-to-handle


def _both(name: str) -> list[str]:
    """A torchrun option in both spellings: --nproc-per-node and --nproc_per_node."""
    return [f"--{name}", *([f"--{name.replace('-', '_')}"] if "-" in name else [])]


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

    def option(name: str, *short: str, **kwargs: Any) -> None:
        same.add_argument(*short, *_both(name), **kwargs)

    option("nproc-per-node", metavar="N|gpu|cpu|auto",
           help="ranks to start (default: one per visible card, else 1)")
    option("module", "-m", action="store_true", help="SCRIPT is a module name, run as `python -m`")
    option("no-python", action="store_true", help="SCRIPT is a program, run without python")
    option("standalone", action="store_true", help="accepted: levers9 run is always standalone")
    option("nnodes", default="1", metavar="N|MIN:MAX",
           help="nodes, each running levers9 run (MIN:MAX waits for MAX: levers9 does not resize)")
    option("node-rank", default="0", help="this node's number (static rendezvous)")
    option("master-addr", help="across nodes: node 0's address (default 127.0.0.1)")
    option("master-port", type=int,
           help="the port the ranks see as MASTER_PORT: across nodes, node 0's store (default 29500); on one "
                "machine, the ranks' store when it is free, else a free one, said")
    option("rdzv-backend", help="static (default) or c10d")
    option("rdzv-endpoint", help="c10d: HOST[:PORT] of the host")
    option("rdzv-id", help="the run's id, the same on every node")
    option("rdzv-conf", help="join_timeout=SECONDS (default 600), is_host=0|1")
    option("max-restarts", type=int, default=0,
           help="start every rank again after any failure (as torchrun), up to N times; "
                "--restart-on narrows it")
    option("start-method", choices=("spawn", "fork", "forkserver"),
           help="default: fork where safe (fast), fresh interpreters otherwise")
    option("local-ranks-filter", default="",
           help="show only these ranks' output on the console, e.g. 0 or 0,2")
    option("log-dir", help="torchrun's log folder: LOG_DIR/<run id>_<random>/attempt_<n>/<local rank>/ with "
                           "error.json, and {stdout,stderr}.log for the streams --redirects/--tee name")
    option("redirects", "-r", default="0",
           help="streams written to the log files only: 1 stdout, 2 stderr, 3 both, "
                "or per local rank (0:1,1:2)")
    option("tee", "-t", default="0",
           help="streams written to the log files and the console, after '[<role><local rank>]:'")
    option("monitor-interval", type=float, help="accepted, no effect: levers9 is told of every exit at once")
    option("role", default="default", help="the ranks' ROLE_NAME, and the --tee prefix")
    option("run-path", action="store_true",
           help="run SCRIPT with runpy.run_path (takes precedence over -m and --no-python)")
    option("event-log-handler", default="null",
           help="null only: levers9 run has no torchelastic agent, so none of its events happen")
    for stream in ("stdout", "stderr"):
        option(f"duplicate-{stream}-filters", default="",
               help=f"copy teed {stream} lines holding one of these words (comma-separated) to "
                    f"attempt_<n>/filtered_{stream}.log")
    option("local-addr", help="this machine's loopback only (every rank meets on loopback)")
    option("logs-specs",
           help="a torchrun.logs_specs entry point: the LogsSpecs class that places the log files")
    option("numa-binding", help="not accepted: levers9 binds no rank to CPUs")
    option("signals-to-handle", default=",".join(HANDLED_SIGNALS),
           help="signals that stop every rank (with its grace) and end levers9 run, e.g. SIGTERM,SIGUSR1")
    option("shutdown-timeout", type=float,
           help="seconds each rank gets between SIGTERM and SIGKILL when stopped (default: "
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 5)")
    option("virtual-local-rank", action="store_true",
           help="LOCAL_RANK 0 in every rank, and CUDA_VISIBLE_DEVICES its own card only")
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
    own.add_argument("--restart-on", metavar="KINDS",
                     help=f"the failures --max-restarts restarts after (default, as torchrun: {','.join(TORCHRUN_RESTART_ON)}; "
                          f"--timeout's is left out), e.g. crash,comm,lost to leave exceptions and exit codes out")
    own.add_argument("--restart-delay", type=float, metavar="SECONDS",
                     help="wait this long between attempts (default 1)")
    parser.add_argument("script", metavar="SCRIPT_OR_MODULE", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    parser.set_defaults(handler=main)
    read_pet_variables(parser, os.environ)  # each torchrun option's PET_ variable, as torchrun reads it


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


def main(args: argparse.Namespace) -> int:
    """Run the script on every rank; the exit status follows torchrun's rules."""
    agent: TorchrunAgent | None = None
    try:
        check(args)
        layout = torchrun_nodes.layout_of(args)  # None for one node
        across_nodes = slurm_gang.check_one_task_per_node(os.environ, "levers9 run")  # srun, a task per node
        if across_nodes:
            slurm_gang.not_a_rank()
        elif layout is None:
            _refuse_multi_node(args)
        _refuse_without_meaning_here(args)
        console_ranks = _console_ranks(args.local_ranks_filter)
        files_asked = args.redirects not in ("0", "") or args.tee not in ("0", "")
        target = scripts.prepare(
            args.script,
            args.script_args,
            module=args.module and not args.run_path,
            no_python=args.no_python and not args.run_path,
            run_path=args.run_path,
            console_ranks=None if files_asked else console_ranks,  # with files, torch's LogsSpecs filters (below)
            what="levers9 run",
        )
        count, backend = scripts.resolve_nprocs(args.nproc_per_node, None, flag="--nproc-per-node")
        scripts.say_one_thread_each(count)
        agent = _agent(args, console_ranks, one_node=layout is None)
        place = None
        if layout is not None:  # --nnodes N (or PET_NNODES): this launcher is one node of N (torchrun_nodes.py)
            place = torchrun_nodes.join(layout, count)
        elif across_nodes:  # srun with one task per node: this task starts its node's share (slurm_gang.py)
            gang = slurm_gang.gang_of_step(os.environ, count)
            place = torchrun_nodes.NodePlace(gang, slurm_gang.launcher_job(gang))
        options = RunOptions(
            nprocs=count if place is None else place.gang.world_size,
            backend=backend,
            timeout=args.timeout,
            stall_timeout=args.stall_timeout,
            start_method="spawn" if args.start_method == "forkserver" else args.start_method,
            prefix_output=not args.no_prefix,
            stop_grace=_stop_grace(args.shutdown_timeout),
            max_restarts=args.max_restarts,
            restart_on=TORCHRUN_RESTART_ON if args.restart_on is None else _restart_words(args.restart_on),
            restart_delay=args.restart_delay,
            init_group=False,  # the script makes its own group, as under torchrun
            caller="levers9 run",
            agent=agent,
        )
        call = functools.partial(run_with, scripts.run_script_target, target, options)
        with torchrun_agent.stops_on(_signals(args.signals_to_handle)):
            if place is None:
                call()
            else:
                slurm_gang.run_as_node(place.gang, place.job, {}, call, place.server)
    except (ConfigError, LauncherEnvError) as exc:
        if scripts.failure_of(exc) is not None:  # raised on a rank (e.g. init_process_group's world_size)
            return _report_failure(exc, agent)
        print(f"levers9 run: error: {str(exc).removeprefix('levers9 run: ')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("levers9 run: interrupted; every rank was stopped.", file=sys.stderr)
        return 130
    except SystemExit as exc:  # SIGTERM, SIGHUP or another --signals-to-handle signal to this process
        if not (isinstance(exc.code, int) and exc.code > 128):
            raise
        print(f"levers9 run: got {signal_name(exc.code - 128)}; every rank was stopped.", file=sys.stderr)
        return exc.code if args.rank_exit_status else 1  # torchrun's agent exits 1 here too
    except BaseException as exc:  # noqa: BLE001 - a rank's failure becomes the exit status
        code = _report_failure(exc, agent)
        return code if args.rank_exit_status else 1
    finally:
        if agent is not None:
            agent.close()
    return 0


ALSO_FAILED = "\nAlso failed, after the root cause:\n"  # where each other failed rank's report begins (restarts.py)


def _agent(args: argparse.Namespace, console_ranks: tuple[int, ...] | None, *, one_node: bool) -> TorchrunAgent:
    """What torchrun's agent would give this run's ranks besides their variables (levers9.distributed.torchrun_agent).
    Across nodes --master-port is node 0's store (torchrun_nodes.py), not a port for this node's ranks."""
    try:
        specs = torchrun_agent.logs_specs(args.logs_specs, args.log_dir, args.redirects, args.tee,
                                          None if console_ranks is None else set(console_ranks))  # fmt: skip
    except ValueError as exc:
        raise ConfigError(
            f"--redirects {args.redirects!r} / --tee {args.tee!r} / --logs-specs {args.logs_specs!r}: {exc}. Expected "
            f"0 to 3 (1 stdout, 2 stderr, 3 both), or per local rank as 0:1,1:2, and a torchrun.logs_specs entry point "
            f"that is installed; pass e.g. --tee 3."
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"--log-dir {args.log_dir}: cannot make a log folder there ({exc.strerror or exc}). Expected a folder you "
            f"can write; pass another --log-dir, or leave it out."
        ) from None
    return TorchrunAgent(
        specs,
        role=args.role,
        prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        stdout_filters=torchrun_agent.split_filters(args.duplicate_stdout_filters),
        stderr_filters=torchrun_agent.split_filters(args.duplicate_stderr_filters),
        virtual_local_rank=args.virtual_local_rank,
        master_port=args.master_port if one_node else None,
        run_id=f"{LEVERS9_RUN_ID_PREFIX}{os.getpid()}-{secrets.token_hex(4)}",
        made_root=torchrun_agent.root_made_for(specs, args.log_dir),
    )


def _restart_words(text: str) -> tuple[str, ...]:
    return tuple(word.strip() for word in text.split(",") if word.strip())


def _stop_grace(shutdown_timeout: float | None) -> float:
    """Seconds between SIGTERM and SIGKILL: --shutdown-timeout, else TORCH_ELASTIC_SHUTDOWN_TIMEOUT (torchrun's
    variable), else levers9's 5."""
    if shutdown_timeout is not None:
        return shutdown_timeout
    text = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if text is None:
        return STOP_GRACE_S
    try:
        return float(text)
    except ValueError:
        raise ConfigError(
            f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={text!r}; expected seconds, e.g. 30. Set a number, or pass --shutdown-timeout."
        ) from None


def _refuse_without_meaning_here(args: argparse.Namespace) -> None:
    """ConfigError for torchrun options that have no meaning for levers9 run on one machine, each saying why."""
    if args.local_addr is not None and args.local_addr not in LOCAL_HOSTS:
        raise ConfigError(
            f"--local-addr {args.local_addr}: the address other nodes reach this one by; levers9 run's ranks all meet "
            f"on this machine's loopback, so it has no meaning here. Expected localhost or 127.0.0.1; drop it. "
            f"{MULTI_NODE_FIX}"
        )
    if args.event_log_handler != "null":
        raise ConfigError(
            f"--event-log-handler {args.event_log_handler}: torchrun's agent records its own events (rendezvous, "
            f"restarts) through it, and levers9 run has no such agent, so there are none to record. Expected null "
            f"(the default); drop it. levers9 run says each restart on stderr."
        )
    if args.numa_binding is not None:
        raise ConfigError(
            f"--numa-binding {args.numa_binding}: levers9 run binds no rank to CPUs. Expected it left out; bind "
            f"inside the script (os.sched_setaffinity), or run this job with torchrun."
        )
    if args.monitor_interval is not None and args.monitor_interval <= 0:
        raise ConfigError(f"--monitor-interval {args.monitor_interval}; expected seconds > 0, e.g. 0.1.")


def _signals(text: str) -> tuple[signal.Signals, ...]:
    """--signals-to-handle as signals; ConfigError naming an unknown one."""
    found = []
    for name in _restart_words(text):
        number = getattr(signal, name.upper(), None)
        if not isinstance(number, signal.Signals) or name.upper().startswith("SIG_"):
            raise ConfigError(
                f"--signals-to-handle names {name!r}, which is not a signal; expected names such as "
                f"{','.join(HANDLED_SIGNALS)},SIGUSR1. Pass e.g. --signals-to-handle SIGTERM,SIGUSR1."
            )
        if number in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"--signals-to-handle names {name}, which no process can handle; drop it.")
        found.append(number)
    return tuple(found)


def _report_failure(exc: BaseException, agent: TorchrunAgent | None) -> int:
    """Print the failing rank's headline and its own traceback (or, where it left none, its error file's), why it
    was not restarted, and return that rank's own exit status (1 for an exception, N for sys.exit(N), 128+N for
    signal N)."""
    failure = scripts.failure_of(exc)
    restarts = _restart_account(exc)
    if failure is None:
        if isinstance(exc, RankFailed):  # a timeout or a stall: the report says where every rank was (and the attempts)
            notes = [line for line in restarts if line.startswith("levers9 run: not restarted")]
            print("\n".join([_ours(str(exc)), *notes]), file=sys.stderr, flush=True)
            return 1
        import traceback  # one rank, run in place: the script's own exception

        print(scripts.user_traceback("".join(traceback.format_exception(exc))), file=sys.stderr)
        return 1
    text = str(exc.__cause__ or exc).split(LAST_ATTEMPT, 1)[-1].lstrip("\n")  # the last attempt's report
    lines = [_ours(text.split("\n", 1)[0])]
    where, recorded = (agent.error_report(failure.rank) if agent is not None else None) or ("", "")
    at = [where] if where else []
    if failure.traceback:
        lines += ["", f"Traceback from rank {failure.rank}:", scripts.user_traceback(failure.traceback).rstrip()]
        lines += at
    elif recorded:
        lines += ["", f"From rank {failure.rank}'s error file (torch's @record):", *at, recorded]
    elif "\n" in text:
        lines += ["", text.split("\n", 1)[1].strip()]
    also = ALSO_FAILED + ALSO_FAILED.join(text.split(ALSO_FAILED)[1:])  # each other failed rank's report, once
    if failure.traceback and also != ALSO_FAILED:
        lines += [scripts.user_traceback(also).rstrip()]
    code = scripts.exit_code_for(exc)
    lines += ["", *restarts, f"levers9 run: rank {failure.rank}'s exit status was {code}."]
    print("\n".join(lines), file=sys.stderr, flush=True)
    return code


def _restart_account(exc: BaseException) -> list[str]:
    """Why the failure was not restarted, and the attempts before it, as restarts.py wrote them (a note on the
    error, or the top of a levers9 error's message above its last attempt's report); [] when nothing was said."""
    said = []
    for note in getattr(exc, "__notes__", ()):
        if note.startswith("levers9: not restarted"):
            said.append("levers9 run: " + note.removeprefix("levers9: "))
        elif note.startswith("levers9: levers9 run: "):
            said.append(note.removeprefix("levers9: "))
    report = str(exc.__cause__ or exc)
    if LAST_ATTEMPT in report:
        said.append(report.split(LAST_ATTEMPT, 1)[0].rstrip())
    return said


def _ours(text: str) -> str:
    return text.replace("distributed.run:", "levers9 run:", 1).replace("distributed.run ", "levers9 run ", 1)


# torchrun reads every option's default from `PET_` + its destination in capitals (torch's
# distributed/argparse_util.py: `env` for an option with a value, `check_env` for a flag, where "1" is on
# and "0" off); a flag on the command line wins. Kubeflow's PyTorchJob and TrainJob start `torchrun
# train.py` with nothing but PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and
# PET_MASTER_PORT: a drop-in that ignored them would run a world of one on each node.

# torchrun's options (their argparse destinations) and whether each is a flag (check_env) or takes a value (env).
TORCHRUN_OPTIONS: dict[str, bool] = {
    "nnodes": False, "nproc_per_node": False, "rdzv_backend": False, "rdzv_endpoint": False, "rdzv_id": False,
    "rdzv_conf": False, "standalone": True, "max_restarts": False, "monitor_interval": False, "start_method": False,
    "event_log_handler": False, "role": False, "module": True, "no_python": True, "run_path": True, "log_dir": False,
    "redirects": False, "tee": False, "local_ranks_filter": False, "duplicate_stdout_filters": False,
    "duplicate_stderr_filters": False, "node_rank": False, "master_addr": False, "master_port": False,
    "local_addr": False, "signals_to_handle": False, "shutdown_timeout": False, "virtual_local_rank": True,
}  # fmt: skip
PROBLEMS = "pet_problems"  # the Namespace attribute that holds what `check` refuses


def read_pet_variables(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Make every torchrun option of `parser` default to its PET_ variable where that is set (a command-line
    flag still wins; a value is checked as the option's is); a flag's variable that is not a whole number,
    or a value outside the option's choices, is noted for `check`."""
    problems = []
    for action in parser._actions:
        name = f"PET_{action.dest.upper()}"
        if action.dest not in TORCHRUN_OPTIONS or name not in env:
            continue
        text = env[name]
        if TORCHRUN_OPTIONS[action.dest]:
            try:
                action.default = bool(int(text))
            except ValueError:
                problems.append(f"{name}={text!r}; expected 1 or 0 (torchrun reads it as a whole number)")
        elif action.choices and text not in action.choices:
            problems.append(f"{name}={text!r}; expected one of {', '.join(map(str, action.choices))}")
        else:
            action.default = text  # argparse converts a default string by the option's type, as a flag's value
    parser.set_defaults(**{PROBLEMS: problems})


def check(args: argparse.Namespace) -> None:
    """ConfigError for the first PET_ variable `levers9 run` could not honour (see `read_pet_variables`)."""
    problems = getattr(args, PROBLEMS, [])
    if problems:
        raise ConfigError(f"{problems[0]}. Unset it, or set it as torchrun's option takes it.")
