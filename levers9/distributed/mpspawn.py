"""`distributed.spawn`: torch.multiprocessing.spawn's signature and meaning on distributed.run's ranks.

An mp.spawn script switches by changing one import (`from levers9.distributed import spawn`) and
gains the fast start and failure reports that name the rank and carry its traceback. Each rank gets
what mp.spawn gives it: the caller's environment (no launcher variables), no process group, fn(i, *args).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from levers9.distributed.spawn_errors import ProcessExited, ProcessRaised
from levers9.distributed.started_ranks import start_like_mp_spawn
from levers9.errors import ConfigError


def spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str | None = None,
    *,
    prefix_output: bool = False,
) -> Any:
    """Call `fn(i, *args)` in `nprocs` processes (i = 0 .. nprocs-1) and wait for all of them.

    As torch.multiprocessing.spawn: each process gets the caller's environment (no RANK / MASTER_*
    variables, no store, no group; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME=lo when unset), and a
    failing process raises what mp.spawn raises, once the others were stopped. Except: rank 0's
    return value is returned (torch returns None).

    Args:
        fn: A function called as `fn(i, *args)` in each process.
        args: The rest of fn's arguments, a tuple.
        nprocs: How many processes, at least 1.
        join: Must be True (levers9 waits so that a failure stops every rank); False is refused.
        daemon: Accepted for compatibility; ranks always end with the caller.
        start_method: None (the default) forks where that is safe and starts fresh interpreters
            otherwise; "fork" or "spawn" insist ("forkserver" counts as "spawn").
        prefix_output: Put "[rank N] " before lines from processes other than 0 (default off: a
            process's output passes through as under mp.spawn).

    Returns:
        What fn returned in process 0.

    Raises:
        ConfigError: A bad argument (join=False included), before anything starts.
        ProcessRaised: A process raised: torch's `ProcessRaisedException` (`.error_index`, `.error_pid`,
            its traceback in the message) and levers9's `RankFailed` (`.failure`, `.kind`).
        ProcessExited: A process exited non-zero or died by a signal: torch's `ProcessExitedException`
            (`.exit_code`, `.signal_name`) and levers9's `RankCrashed`.
    """
    if not callable(fn):
        raise ConfigError(f"spawn: fn is {type(fn).__name__} {fn!r}; expected a function called as fn(i, *args).")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ConfigError(f"spawn: nprocs={nprocs!r}; expected a whole number >= 1, e.g. spawn(fn, nprocs=2).")
    if not isinstance(args, tuple):
        raise ConfigError(f"spawn: args={args!r} ({type(args).__name__}); expected a tuple, e.g. args=(world_size,).")
    if not join:
        raise ConfigError(
            "spawn: join=False; levers9 waits for its ranks so that a failure stops them all and is raised here, "
            "and returns no ProcessContext. Expected join=True; run spawn(...) in a thread if the caller must go on, "
            "or keep torch.multiprocessing.spawn for join=False."
        )
    if start_method == "forkserver":
        start_method = "spawn"
    try:
        return start_like_mp_spawn(functools.partial(_call_with_rank, fn, args), nprocs, start_method, prefix_output)
    except (ProcessRaised, ProcessExited) as exc:
        # raised from the caller's line: levers9's layers that started and watched the processes are no part of it
        raise exc.with_traceback(None) from None


def _call_with_rank(fn: Callable[..., Any], args: tuple[Any, ...], rank: int) -> Any:
    """What each rank runs: fn(rank, *args), where rank is this process's index among the ranks started."""
    return fn(rank, *args)
