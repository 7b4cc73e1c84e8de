"""Functions run on ranks or in jobs by test_run_script.py (importable, so a fresh interpreter finds them)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def torchrun_main() -> dict[str, Any]:
    """A main() written for torchrun: it makes the group itself and destroys it at the end."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    launched = dist.is_torchelastic_launched()
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "sum": total.item(), "elastic": launched}


def torchrun_main_then_helpers() -> float:
    """A user group made and destroyed, then a levers9 helper, which makes (and later destroys) its own."""
    import torch.distributed as dist

    from levers9 import distributed as l9

    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
    return float(l9.all_reduce_mean(float(l9.rank())).item())


def tutorial_worker(rank: int, world_size: int, port: int, out: str) -> None:
    """The PyTorch DDP tutorial's mp.spawn worker: it sets MASTER_ADDR/MASTER_PORT and passes rank and world_size."""
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    Path(out, f"rank{rank}").write_text(f"{value.item()}")
    dist.destroy_process_group()


def failing_worker(rank: int, bad_rank: int) -> None:
    """An mp.spawn worker: rank `bad_rank` raises, the others go on working until they are stopped."""
    import time

    if rank == bad_rank:
        raise KeyError(f"rank {rank} lost its config")
    time.sleep(60)


def job_runs_classic_main() -> Any:
    """A job body: a torchrun-style main on every card of the job."""
    from levers9 import distributed as dist

    return dist.run(torchrun_main, init_group=False)


def job_runs_classic_main_without_the_keyword() -> Any:
    """A job body: a torchrun-style main handed to distributed.run without init_group=False."""
    from levers9 import distributed as dist

    return dist.run(torchrun_main)


def what_fn_sees() -> dict[str, Any]:
    """What code that asks torch.distributed for its place sees at the top of fn (rank 0's answer comes back;
    each rank checks its own against levers9's helpers and fails if they differ)."""
    import torch.distributed as td

    from levers9 import distributed as l9

    seen = {
        "initialized": td.is_initialized(),
        "idiom_rank": td.get_rank() if td.is_initialized() else 0,  # torchmetrics', timm's, detectron2's guard
        "world": td.get_world_size() if td.is_initialized() else 1,
        "group_world_set": td.group.WORLD is not None,
    }
    if (seen["idiom_rank"], seen["world"]) != (l9.rank(), l9.world_size()):
        raise AssertionError(f"torch says rank {seen['idiom_rank']} of {seen['world']}, levers9 {l9.rank()} of {l9.world_size()}")
    ranks = [None] * seen["world"]
    td.all_gather_object(ranks, seen["idiom_rank"])
    return {**seen, "every_rank": ranks}


def job_reports_what_fn_sees() -> Any:
    """A job body: distributed.run on every card of the job, reporting what fn sees at its top."""
    from levers9 import distributed as dist

    return dist.run(what_fn_sees)


def job_runs_script(out: str) -> None:
    """A job body: an unchanged script on every card of the job."""
    from levers9 import distributed as dist

    dist.run_script(str(SCRIPTS / "worker_env.py"), ["--out", out])


def job_runs_script_on_every_card(out: str) -> None:
    """The same script with one rank per card of the job: torchrun's `--nproc-per-node gpu` word."""
    from levers9 import distributed as dist

    dist.run_script(str(SCRIPTS / "worker_env.py"), ["--out", out], nprocs="gpu")


def raw_collective() -> float:
    """torch.distributed called before any group exists, as code written for an eager group does."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return total.item()


def spawned_sees(index: int) -> dict[str, Any]:
    """What an mp.spawn worker sees of launchers before it makes a group (mp.spawn sets no variables)."""
    import torch.distributed as td

    return {
        "rank_var": os.environ.get("RANK"),
        "master_port": os.environ.get("MASTER_PORT"),
        "torchelastic": td.is_torchelastic_launched(),
        "initialized": td.is_initialized(),
        "index": index,
    }


def fresh_record(args: tuple[str, int | None, int | None]) -> None:
    """tests/scripts/fresh_process.py's record(), as a distributed.run fn."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fresh_process", SCRIPTS / "fresh_process.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.record(*args)


def torch_draw() -> list[float]:
    """Three unseeded draws from torch's default generator (a job cell's or a rank's own)."""
    import torch

    return torch.rand(3).tolist()


def peer_killed(mode: str) -> None:
    """Rank 1 ends by a signal ("kill": SIGKILL, "int": SIGINT) after a first barrier; rank 0 reacts to the lost
    peer as many scripts do, with sys.exit(1)."""
    import signal
    import sys
    import time

    import torch.distributed as td

    td.barrier()
    if td.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGINT)
        time.sleep(30)
    try:
        for _ in range(1000):
            td.barrier()
    except Exception:
        sys.exit(1)


def two_ranks_raise() -> None:
    """Ranks 1 and 2 raise, each its own error; rank 0 waits in a barrier."""
    import torch.distributed as td

    if td.get_rank() in (1, 2):
        raise ValueError(f"rank {td.get_rank()} could not read its shard")
    td.barrier()


def leaves_a_thread_running(seconds: float) -> str:
    """Returns at once, leaving a non-daemon thread that runs for `seconds`."""
    import threading
    import time

    threading.Thread(target=time.sleep, args=(seconds,), name="slow-uploader").start()
    return "returned"


def thread_count() -> tuple[int, str | None]:
    import torch

    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def prints_and_returns(value: int) -> int:
    """Prints a line on every rank (or in a job), then returns `value`."""
    print(f"working on {value}", flush=True)
    return value


def spawned_prints(index: int) -> None:
    print(f"process {index} says hi", flush=True)


def job_ends_as_an_interpreter(out: str) -> str:
    """A job that leaves an atexit handler, an unflushed file and a non-daemon thread behind when it returns."""
    import atexit
    import threading
    import time

    atexit.register(lambda: open(os.path.join(out, "atexit"), "w").write("ran"))
    left_open = open(os.path.join(out, "open"), "w")
    left_open.write("seventeen bytes!\n")
    globals()["_left_open"] = left_open

    def save() -> None:
        time.sleep(0.3)
        with open(os.path.join(out, "thread"), "w") as f:
            f.write("saved")

    threading.Thread(target=save).start()
    return "returned"


def leaves_an_executor_open() -> str:
    """Returns with a ThreadPoolExecutor never shut down (its workers are not daemons), as inductor's compile pool is."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(2)
    assert pool.submit(sum, [1, 2]).result() == 3
    globals()["_pool"] = pool
    return "returned"


def redraws_a_progress_line(gate: str) -> None:
    """Each rank redraws a progress line with "\\r", as tqdm does, in three steps: each step's redraw carries the
    time it was written (time.monotonic(), one clock for every process here) and waits for the file
    `gate`.<rank>.<step>, which the test makes once it read that redraw from the launcher's output; then the line
    ends. A redraw held back until its line ends is read only once the rank stops waiting, after 20 s."""
    import sys
    import time

    rank = os.environ["RANK"] if "RANK" in os.environ else "0"
    for step in range(3):
        sys.stdout.write(f"\rrank {rank} step {step}/3 at {time.monotonic():.6f} ")
        sys.stdout.flush()
        end = time.monotonic() + 20
        while not os.path.exists(f"{gate}.{rank}.{step}") and time.monotonic() < end:
            time.sleep(0.005)
    sys.stdout.write("done\n")
    sys.stdout.flush()


def ending_worker(rank: int, bad_rank: int, how: str) -> None:
    """An mp.spawn worker: rank `bad_rank` ends as `how` says ("exit": sys.exit(3); "kill": SIGKILL), the others go
    on working until they are stopped."""
    import signal
    import sys
    import time

    if rank == bad_rank:
        if how == "exit":
            sys.exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def every_worker_raises(rank: int) -> None:
    """An mp.spawn worker that raises on every rank, as the DCP recipe's load does when the checkpoint is missing."""
    raise ValueError(f"bad shard on rank {rank}")
