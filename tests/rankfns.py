"""Importable functions that tests run on every rank (fresh-interpreter ranks import them by name)."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch

from levers9 import distributed as dist


class CustomError(Exception):
    """An exception type of the test's own, to check that the original type comes back."""


def describe(cfg: Any) -> dict[str, Any]:
    """Every rank's view of the world, gathered through a real all_reduce; rank 0 returns it."""
    mean = dist.all_reduce_mean(torch.tensor([float(dist.rank())]))
    return {
        "rank": dist.rank(),
        "world_size": dist.world_size(),
        "local_rank": dist.local_rank(),
        "launcher": dist.launcher(),
        "mean_rank": mean.item(),
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
        "cfg": cfg,
        "pid": os.getpid(),
    }


def variable_on_every_rank(name: str) -> list[str | None]:
    """`name` in each rank's environment, gathered from every rank; rank 0 returns the list."""
    seen: list[str | None] = [None] * dist.world_size()
    torch.distributed.all_gather_object(seen, os.environ.get(name))
    return seen


def fail_on_rank_1(cfg: Any) -> None:
    """Rank 1 raises CustomError; rank 0 waits in a collective it will never complete."""
    if dist.rank() == 1:
        raise CustomError(f"bad value {cfg!r} on rank 1")
    dist.barrier()
    time.sleep(60)


class Unprintable(Exception):
    """An exception whose str() itself raises."""

    def __str__(self) -> str:
        raise RuntimeError("no words for it")


def unprintable_on_rank_1(cfg: Any) -> None:
    if dist.rank() == 1:
        raise Unprintable("the real trouble")
    dist.barrier()


def exit_3_on_rank_1(cfg: Any) -> None:
    if dist.rank() == 1:
        sys.exit(3)
    dist.barrier()


def os_exit_on_rank_1(cfg: Any) -> None:
    if dist.rank() == 1:
        print("about to leave", flush=True)
        os._exit(7)
    dist.barrier()


def kill_self_on_rank_1(cfg: Any) -> None:
    if dist.rank() == 1:
        os.kill(os.getpid(), cfg or signal.SIGKILL)
        time.sleep(10)
    dist.barrier()


def sleep_forever(cfg: Any) -> None:
    print(f"sleeping on rank {dist.rank()}", flush=True)
    time.sleep(600)


def spin_forever(cfg: Any) -> None:
    """Python code that never ends (a timeout stops it at its next instruction)."""
    while True:
        time.sleep(0.01)


def value_of_a_module_only_rank_0_imports(folder: str) -> Any:
    """Rank 0 imports a module from `folder` (not on the caller's path) and returns one of its objects."""
    dist.barrier()
    if dist.rank() != 0:
        return None
    sys.path.insert(0, folder)
    import only_rank_0_has_it  # type: ignore[import-not-found]

    return only_rank_0_has_it.Thing()


def first_ten_of_a_big_tensor(cfg: Any) -> dict[str, Any]:
    """Ten floats that view a 100 MB tensor's storage (as `big[:10]` does), alone and in a dict."""
    big = torch.arange(25_000_000, dtype=torch.float32)
    return {"head": big[:10], "pid": os.getpid()}


def rank1_stops_itself_after_a_barrier(cfg: Any) -> None:
    dist.barrier()
    if dist.rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.barrier()


def big_result(cfg: Any) -> bytes:
    """Rank 0 returns far more than a pipe buffer holds."""
    return b"x" * (cfg or 50_000_000)


def unpicklable_result(cfg: Any) -> dict[str, Any]:
    import threading

    return {"ok": 1, "lock": threading.Lock()}


def grandchild_then_fail(cfg: Any) -> None:
    """Each rank starts a long-lived grandchild (a DataLoader worker stand-in) and writes its pid; rank 1 fails."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(os.path.join(cfg, f"grandchild-{dist.rank()}"), "w") as f:
        f.write(str(child.pid))
    dist.barrier()
    if dist.rank() == 1:
        raise CustomError("rank 1 fails after starting a grandchild")
    time.sleep(60)


def helper_answers(cfg: Any) -> dict[str, Any]:
    """What each helper answers on this rank, reduced or gathered so rank 0 can return all of it."""
    x = torch.tensor([1.0, 2.0]) * (dist.rank() + 1)
    before = x.clone()
    mean = dist.all_reduce_mean(x)
    ints = dist.all_reduce_mean(torch.tensor([dist.rank() * 3]))
    number = dist.all_reduce_mean(dist.rank() * 10)
    rows = list(range(7))
    mine = dist.shard(rows)
    padded = dist.shard(rows, pad=True)
    lengths = dist.all_reduce_mean(torch.tensor([float(len(mine))])) * dist.world_size()
    dist.print0(f"print0 from rank {dist.rank()}")
    dist.barrier()
    model = dist.wrap(torch.nn.Linear(2, 1), find_unused_parameters=False)
    return {
        "mean": mean.tolist(),
        "input_untouched": bool(torch.equal(x, before)),
        "ints": (ints.item(), str(ints.dtype)),
        "number": number.item(),
        "rows_covered": lengths.item(),
        "rank0_rows": list(mine),
        "padded": (padded.rows, padded.padding),
        "ddp": type(model).__name__,
        "device": str(dist.device()),
    }


def accelerate_adopts(cfg: Any) -> dict[str, Any]:
    """accelerate's PartialState / Accelerator created inside fn join the group run() made."""
    from accelerate import Accelerator, PartialState

    group_before = torch.distributed.is_initialized()
    state = PartialState(cpu=True)  # on a CPU box accelerate itself needs cpu=True (as under `accelerate launch`)
    acc = Accelerator(cpu=True)
    t = acc.reduce(torch.tensor([float(acc.process_index)]), reduction="sum")
    return {
        "num_processes": state.num_processes,
        "process_index": state.process_index,
        "accelerator_processes": acc.num_processes,
        "sum": t.item(),
        "group_before": group_before,
    }


def rank1_sleeps_in_a_formed_group(cfg: Any) -> None:
    """The same in a group formed first, as torchrun code does: rank 0 waits inside gloo's all_reduce."""
    form_group_as_torchrun_code_does()
    rank1_sleeps_before_all_reduce(cfg)


def mark_stall_start(cfg: Any) -> None:
    """Write when the stall begins (the machine-wide monotonic clock) to the file `cfg` names, if it names one."""
    if isinstance(cfg, str):
        with open(cfg + ".tmp", "w") as f:
            f.write(repr(time.monotonic()))
        os.replace(cfg + ".tmp", cfg)


def rank1_sleeps_before_all_reduce(cfg: Any) -> None:
    """Rank 0 waits in all_reduce while rank 1 sleeps (alive, not in a collective)."""
    if dist.rank() == 1:
        mark_stall_start(cfg)
        time.sleep(60)  # STALL-LINE rank 1
    torch.distributed.all_reduce(torch.ones(1))


def form_group_as_torchrun_code_does() -> None:
    """The guard that code written for torchrun and for a launcher-made group uses (timm, detectron2): inside
    distributed.run the group is already live, so it makes none."""
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")


def rank1_skips_barrier(cfg: Any) -> None:
    """Rank 1 skips the barrier rank 0 waits in, and keeps computing."""
    form_group_as_torchrun_code_does()
    if dist.rank() == 0:
        dist.barrier()
    else:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # SKIP-LINE rank 1
            sum(range(1000))


def slow_but_progressing(cfg: Any) -> int:
    """Many collectives, each rank arriving up to `cfg` seconds late: slow, never stalled."""
    for step in range(8):
        time.sleep(cfg if (step + dist.rank()) % 2 else 0.0)
        torch.distributed.all_reduce(torch.ones(1))
    return 8


def rank0_ahead_by_an_async_collective(cfg: Any) -> None:
    """Rank 0 issues an all_reduce and moves on (as NCCL's return-on-enqueue does); rank 1 never issues it."""
    form_group_as_torchrun_code_does()
    if dist.rank() == 0:
        torch.distributed.all_reduce(torch.ones(1), async_op=True)
        time.sleep(60)  # AHEAD-LINE
    else:
        time.sleep(60)  # BEHIND-LINE


def rank1_sleeps_before_a_functional_all_reduce(cfg: Any) -> None:
    """Rank 0 waits for an all_reduce issued from C++ (functional collectives), never through torch.distributed.all_reduce."""
    from torch.distributed import _functional_collectives as funcol

    form_group_as_torchrun_code_does()
    # A first one on both ranks: waiting on a functional collective's result first imports torch._dynamo,
    # which takes seconds on a loaded machine; the stall to be named is the wait itself, in the second one.
    funcol.all_reduce(torch.ones(1), "sum", torch.distributed.group.WORLD).item()
    if dist.rank() == 1:
        mark_stall_start(cfg)
        time.sleep(60)  # FUNCOL-SLEEP-LINE
    reduced = funcol.all_reduce(torch.ones(1), "sum", torch.distributed.group.WORLD)
    reduced.item()  # FUNCOL-WAIT-LINE


def progressing_then_computing(cfg: Any) -> int:
    """Collectives of several kinds (some from C++), ranks arriving late in turn, then a long stretch with none."""
    from torch.distributed import _functional_collectives as funcol

    model = dist.wrap(torch.nn.Linear(2, 1))
    for step in range(6):
        time.sleep(cfg if (step + dist.rank()) % 2 else 0.0)
        model(torch.ones(1, 2)).sum().backward()
        funcol.all_reduce(torch.ones(1), "sum", torch.distributed.group.WORLD).item()
        dist.barrier()
    time.sleep(3 * cfg)  # every rank computes; nobody waits
    return 6


def job_that_stalls() -> None:
    """A job function whose distributed.run stalls (rank 1 sleeps before an all_reduce)."""
    dist.run(rank1_sleeps_before_all_reduce, None, nprocs=2)


def rank1_stalls_before_a_ddp_step(cfg: Any) -> None:
    """Rank 0 reaches backward() of a DDP step (and waits for the gradient all-reduce); rank 1 sleeps first."""
    model = dist.wrap(torch.nn.Linear(4, 1))
    for step in range(3):
        if step == 2 and dist.rank() == 1:
            time.sleep(60)  # DDP-SLEEP-LINE
        model(torch.ones(2, 4)).sum().backward()  # DDP-BACKWARD-LINE


def killed_like_the_oom_killer_on_rank_1(counter_file: str | None) -> None:
    """Rank 1 dies by SIGKILL; with `counter_file` (a stand-in cgroup's memory.events or
    memory.oom_control) it first raises the oom_kill count there, as the kernel's OOM killer does."""
    if dist.rank() == 1:
        if counter_file:
            bump_oom_kill(counter_file)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)
    dist.barrier()


def bump_oom_kill(counter_file: str) -> None:
    """Add one to the `oom_kill N` line of a cgroup counter file, keeping its other lines."""
    with open(counter_file) as f:
        lines = f.read().splitlines()
    lines = [f"oom_kill {int(line.split()[1]) + 1}" if line.startswith("oom_kill ") else line for line in lines]
    partial = counter_file + ".partial"
    with open(partial, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(partial, counter_file)


def checkpoint_on_sigterm_when_rank_0_fails(folder: str) -> None:
    """Rank 1 saves a checkpoint in its SIGTERM handler; rank 0 fails once rank 1 is ready for it."""
    ready, saved = os.path.join(folder, "ready"), os.path.join(folder, "checkpoint")

    def save_and_leave(signum: int, frame: Any) -> None:
        with open(saved, "w") as f:
            f.write("step 7")
        sys.exit(0)

    if dist.rank() == 1:
        signal.signal(signal.SIGTERM, save_and_leave)
        open(ready, "w").close()
        time.sleep(60)
    while not os.path.exists(ready):
        time.sleep(0.01)
    raise CustomError("rank 0 gives up")


def ignore_sigterm_with_a_grandchild_when_rank_0_fails(folder: str) -> None:
    """Rank 1 and a grandchild of its own ignore SIGTERM; rank 0 fails once both are there."""
    if dist.rank() == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        grandchild = os.fork()
        if grandchild == 0:
            time.sleep(60)
            os._exit(0)
        with open(os.path.join(folder, ".pids"), "w") as f:
            f.write(f"{os.getpid()} {grandchild}")
        os.replace(os.path.join(folder, ".pids"), os.path.join(folder, "pids"))
        time.sleep(60)
    while not os.path.exists(os.path.join(folder, "pids")):
        time.sleep(0.01)
    raise CustomError("rank 0 gives up")


OTHER_UID = 65534  # nobody: another local user


def what_another_user_reaches_in_the_store(cfg: Any) -> dict[str, Any]:
    """On rank 0, once the group is made: a child that became another user connects to the run's store (any
    local user can reach a TCP port) and says whether it read this rank's environment and which of the
    keys the ranks' group read it could name as they would be without the run's secret; then, as this
    user, which it can name with the secret."""
    import datetime
    import json

    import torch.distributed as td

    dist.barrier()
    if dist.rank() != 0:
        return {}
    port = int(os.environ["LEVERS9_STORE_PORT"])
    secret = os.environ.get("LEVERS9_STORE_SECRET", "")
    rank0 = os.getpid()

    def gloo_keys(prefix: str) -> list[str]:  # where gloo's ranks publish the addresses the others connect to
        return [f"{prefix}/0//cpu//0/{r}" for r in range(dist.world_size())]

    def present(keys: list[str]) -> list[str]:
        store = td.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
        return [k for k in keys if store.check([k])]

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the other user
        try:
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            seen: dict[str, Any] = {}
            try:
                with open(f"/proc/{rank0}/environ", "rb") as environ:
                    seen["environ"] = b"LEVERS9_STORE_SECRET" in environ.read()
            except PermissionError:
                seen["environ"] = False
            seen["guessed"] = present(gloo_keys("levers9-group-1/"))
            os.write(write_end, json.dumps(seen).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        seen = json.loads(answer.read() or b"{}")
    os.waitpid(pid, 0)
    seen["with_secret"] = present(gloo_keys(f"levers9-{secret}-group-1/"))
    seen["secret"] = secret
    return seen


def interpreter_flags() -> dict[str, Any]:
    """How this interpreter was started: whether an assert statement runs (-O strips it), and the flags -O and -I
    set (-I also ignores PYTHON* variables, such as PYTHONDONTWRITEBYTECODE)."""
    try:
        assert os.getpid() < 0, "an assert that python -O strips"
        asserts_run = False
    except AssertionError:
        asserts_run = True
    flags = sys.flags
    return {"asserts_run": asserts_run, "optimize": flags.optimize, "isolated": flags.isolated,
            "dont_write_bytecode": flags.dont_write_bytecode}  # fmt: skip


def interpreter_flags_on_every_rank() -> list[dict[str, Any]]:
    """`interpreter_flags()` of every rank, gathered; rank 0 returns the list."""
    seen: list[dict[str, Any] | None] = [None] * dist.world_size()
    torch.distributed.all_gather_object(seen, interpreter_flags())
    return seen  # type: ignore[return-value]
