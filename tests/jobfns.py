"""Importable job functions for the job-layer tests (a fresh interpreter imports them by name)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


class CellError(Exception):
    """A user exception that pickles and unpickles (rebuilt with its type)."""


class Unrebuildable(Exception):
    """A user exception whose __init__ signature breaks unpickling (comes back as RemoteError)."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"a={a} b={b}")


def report(tag: Any, seconds: float = 0.3) -> dict[str, Any]:
    """Sleep, and say which cards this job saw and when it ran."""
    import levers9

    job = levers9.current_job()
    start = time.time()
    time.sleep(seconds)
    return {
        "tag": tag,
        "cards": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),  # SLURM's test nodes share one host
        "order": os.environ.get("CUDA_DEVICE_ORDER"),
        "simulated": None if job is None else job.simulated,
        "gpu_count": None if job is None else str(job.gpu_count),
        "start": start,
        "end": time.time(),
        "pid": os.getpid(),
    }


def report_once_started(folder: str, tag: Any, seconds: float) -> dict[str, Any]:
    """`report`, after writing folder/started-<tag> (a test waits for it to know the job holds its cards)."""
    write_atomically(Path(folder, f"started-{tag}"), "")
    return report(tag, seconds)


def hold_cards_until_released(folder: str, tag: Any) -> dict[str, Any]:
    """`report`, after writing folder/started-<tag>, once folder/release exists (at most 120 s): the job holds
    its cards for as long as the test needs, whatever the machine's speed."""
    write_atomically(Path(folder, f"started-{tag}"), "")
    deadline = time.monotonic() + 120
    while not Path(folder, "release").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return report(tag, 0)


def report_once_four_run(folder: str, tag: Any, seconds: float) -> dict[str, Any]:
    """`report`, once four cells have written folder/started-<tag> (four cards in use at one time);
    a cell that waits 120 s for them raises, so a backend that runs fewer at once fails, never hangs."""
    write_atomically(Path(folder, f"started-{tag}"), "")
    deadline = time.monotonic() + 120
    while len(list(Path(folder).glob("started-*"))) < 4:
        if time.monotonic() > deadline:
            seen = sorted(p.name for p in Path(folder).glob("started-*"))
            raise RuntimeError(f"cell {tag}: waited 120 s for four cells running at once; started: {seen}")
        time.sleep(0.02)
    return report(tag, seconds)


def add(a: int, b: int = 0) -> int:
    return a + b


class Payload:
    """A result of a given size that a test can hold a weak reference to."""

    def __init__(self, index: int, size: int) -> None:
        self.index, self.data = index, bytes(size)


def payload_or_fail(index: int, size: int, failing: int, gate: str | None = None) -> Payload:
    """A `size`-byte Payload, or, for every `failing`-th index, CellError carrying one. With `gate`, first
    write this process's pid to `gate`-started-<index> and wait until `gate` exists."""
    if gate is not None:
        Path(f"{gate}-started-{index}").write_text(str(os.getpid()))
        while not Path(gate).exists():
            time.sleep(0.02)
    if failing and index % failing == failing - 1:
        raise CellError(f"cell {index} fails on purpose", Payload(index, size))
    return Payload(index, size)


def fail(kind: str, message: str = "boom") -> None:
    """Fail the way `kind` says: an exception, an exit code, or a signal."""
    print(f"about to fail: {kind}", flush=True)
    if kind == "value":
        raise ValueError(message)
    if kind == "custom":
        raise CellError(message)
    if kind == "unrebuildable":
        raise Unrebuildable(1, 2)
    if kind == "exit":
        os._exit(3)
    if kind == "sys.exit":
        sys.exit(4)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError(kind)


def count_attempt(marker: str) -> int:
    """How many attempts came before this one, counted in the marker file (which this one adds to)."""
    path = Path(marker)
    attempts = int(path.read_text()) if path.exists() else 0
    path.write_text(str(attempts + 1))
    return attempts


def crash_once(marker: str) -> str:
    """Crash (exit code 3) on the first attempt, succeed on the next; counts attempts in the marker file."""
    attempts = count_attempt(marker)
    if attempts == 0:
        os._exit(3)
    return f"ok after {attempts + 1} attempts"


def write_atomically(path: Path, text: str) -> None:
    """Write `text` so that a reader sees the whole file or none of it (tests poll for these files)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def pid_and_sleep(folder: str, tag: Any, seconds: float) -> str:
    """Write this job's pid to folder/<tag>.pid (and a child's pid to <tag>.child), then sleep."""
    child = os.fork()
    if child == 0:
        time.sleep(seconds)
        os._exit(0)
    write_atomically(Path(folder, f"{tag}.child"), str(child))
    write_atomically(Path(folder, f"{tag}.pid"), str(os.getpid()))
    time.sleep(seconds)
    return str(tag)


def quick_or_slow(folder: str, index: int) -> int:
    """Cell 0 returns at once; the others write a pid file, sleep long (longer than any test may run), and
    write a done file if they ever wake: a cell that was cancelled never does."""
    if index == 0:
        return 0
    write_atomically(Path(folder, f"{index}.pid"), str(os.getpid()))
    time.sleep(600)
    write_atomically(Path(folder, f"{index}.done"), "")
    return index


def noisy(lines: int) -> int:
    for i in range(lines):
        print(f"line {i} to stdout", flush=True)
    print("a line to stderr", file=sys.stderr, flush=True)
    return lines


def lock_result() -> Any:
    """A result that cannot be pickled."""
    import threading

    return threading.Lock()


def train_one_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """A rank of distributed.run inside a job: reports the world it sees."""
    from levers9 import distributed as dist

    return {"world_size": dist.world_size(), "rank": dist.rank(), "cfg": cfg}


def run_distributed(steps: int) -> Any:
    from levers9 import distributed as dist

    return dist.run(train_one_rank, {"steps": steps})


def counted(folder: str, index: int) -> int:
    """Note this run in folder/<index>.runs (one line per run); fail if folder/fail-<index> exists,
    wait while folder/hold-<index> exists; return index * 10."""
    with open(Path(folder, f"{index}.runs"), "a") as runs:
        runs.write("ran\n")
    if Path(folder, f"fail-{index}").exists():
        raise CellError(f"cell {index} told to fail")
    while Path(folder, f"hold-{index}").exists():
        time.sleep(0.02)
    return index * 10


def counted_with(folder: str, index: int, extra: Any) -> int:
    """counted(folder, index), for cells whose arguments also hold `extra` (sets, objects)."""
    return counted(folder, index)


def when_file_exists(tag: str, path: str | None) -> str:
    """Return `tag` once `path` exists (at once for None)."""
    while path is not None and not os.path.exists(path):
        time.sleep(0.02)
    return tag


def say(text: str) -> str:
    """Print `text` to stderr and return it."""
    print(text, file=sys.stderr, flush=True)
    return text


def noisy_until(gate: str) -> str:
    """Print a line, wait for `gate` to exist, print another, return 'done'."""
    print("waiting for the gate", flush=True)
    while not os.path.exists(gate):
        time.sleep(0.02)
    print("through the gate", flush=True)
    return "done"


def touch(path: str) -> str:
    """Create the file at `path` (tests check whether the job ran at all)."""
    Path(path).touch()
    return path


def killed_like_the_oom_killer(counter_file: str | None) -> None:
    """Die by SIGKILL; with `counter_file` (a stand-in cgroup's counter file) first raise its oom_kill
    count, as the kernel's OOM killer does."""
    from tests.rankfns import bump_oom_kill

    print("allocating", flush=True)
    if counter_file:
        bump_oom_kill(counter_file)
    os.kill(os.getpid(), signal.SIGKILL)


def nested_remote(tag: Any, backend: str | None = None, gpu_count: int = 1) -> dict[str, Any]:
    """A GPU job that starts another GPU job (`gpu_count` cards) and returns both views of the cards."""
    from levers9.launch import job

    inner = job(gpu="RTXPro6000", gpu_count=gpu_count, backend=backend, stream_output=False)(report)
    return {"outer": os.environ.get("CUDA_VISIBLE_DEVICES"), "inner": inner.remote(tag, 0.2)}


def nested_map(cells: int) -> dict[str, Any]:
    """A GPU job that maps `cells` one-card GPU jobs and returns the cards each saw and when it ran."""
    from levers9.launch import job

    inner = job(gpu="RTXPro6000", stream_output=False)(report)
    return {"outer": os.environ.get("CUDA_VISIBLE_DEVICES"), "inner": list(inner.map(range(cells)))}


def slow_once(marker: str) -> str:
    """Outlive any short timeout on the first attempt, return at once on the next; counts attempts in the marker."""
    attempts = count_attempt(marker)
    if attempts == 0:
        time.sleep(60)
    return f"ok after {attempts + 1} attempts"


def raise_once(marker: str) -> str:
    """Raise ValueError on the first attempt, return on the next; counts attempts in the marker."""
    attempts = count_attempt(marker)
    if attempts == 0:
        raise ValueError("first attempt fails")
    return f"ok after {attempts + 1} attempts"


def signals_the_parent_catches() -> list[int]:
    """The signals this process's parent (the job's caller) has a handler for now, from /proc (SigCgt)."""
    with open(f"/proc/{os.getppid()}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
    return [signum for signum in range(1, 65) if mask & (1 << (signum - 1))]


def save_on_sigterm(folder: str, name: Any) -> None:
    """Training that saves a checkpoint when told to stop, as a preemptible job does: on SIGTERM write
    folder/saved-<name> and exit 0. Writes folder/ready-<name> (its pid) once the handler is in place.

    It computes, as a training loop does (pure Python, and a torch op on the CPU where torch is imported),
    never sleeping: a sleep is a system call that the signal interrupts, which runs Python's handler however
    it was delivered, and so hides a handler that computing code would never run (CPython 3.13+ in a child
    forked from a thread other than the main one: interpreter.relay_signals_to_main). Python runs a handler
    in the main thread between two of its instructions, so the steps are short."""

    def save(signum: int, frame: Any) -> None:
        write_atomically(Path(folder, f"saved-{name}"), str(signum))
        sys.exit(0)

    signal.signal(signal.SIGTERM, save)
    write_atomically(Path(folder, f"ready-{name}"), str(os.getpid()))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        train_step()


def seconds_until_handled_from_a_thread_in_c(signum: int, patience: float = 20.0) -> float | None:
    """Put a handler for `signum` in place and have it sent, from another process, to another thread of this one: a
    thread that waits in C without the GIL, as torch's, gloo's and NCCL's do (a mutex wait, which a handler does not
    end), while the main thread computes pure Python, never releasing the GIL. The seconds until the handler ran
    (`patience` or more: it ran only once the main thread made a system call), or None."""
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # a pthread_mutex_t, all zeros: PTHREAD_MUTEX_INITIALIZER on glibc
    libc.pthread_mutex_lock(mutex)
    calling = threading.Event()

    def wait_in_c() -> None:
        calling.set()
        libc.pthread_mutex_lock(mutex)  # ctypes releases the GIL for the call
        libc.pthread_mutex_unlock(mutex)

    waiter = threading.Thread(target=wait_in_c, daemon=True)
    waiter.start()
    calling.wait()
    while not Path(f"/proc/self/task/{waiter.native_id}/wchan").read_text().startswith("futex"):
        time.sleep(0.01)  # until it waits in the kernel for the mutex (this sleep leaves it the GIL to get there)
    ran: list[float] = []
    signal.signal(signum, lambda *_: ran.append(time.monotonic()))
    start = time.monotonic()
    kill = "import ctypes, sys; ctypes.CDLL(None).tgkill(*map(int, sys.argv[1:]))"  # to that one thread
    sender = subprocess.Popen([sys.executable, "-c", kill, str(os.getpid()), str(waiter.native_id), str(int(signum))])
    total = 0
    while not ran and time.monotonic() - start < patience:
        total += sum(i * i for i in range(1_000))
    sender.wait()
    libc.pthread_mutex_unlock(mutex)
    waiter.join()
    return ran[0] - start if ran else None


def train_step() -> None:
    """About a millisecond of work, in Python and (where torch is imported) in a torch op on the CPU."""
    total = 0
    for i in range(5_000):
        total += i * i
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.ones(32, 32) @ torch.ones(32, 32)


def computes_and_saves_slowly_on_sigterm(folder: str, name: Any) -> None:
    """Training that computes in small numeric steps and, on SIGTERM, saves a checkpoint that takes a while:
    it writes folder/stopping-<name>, computes on until folder/go exists (the test makes it once the caller got
    its second signal) and 0.5 s more, then writes folder/saved-<name> and exits 0. Writes folder/ready-<name>
    (its pid) once the handler is in place; stops computing after 120 s."""

    def step(x: float) -> float:
        for _ in range(1000):
            x = (x * 1.000001 + 0.5) % 1000.0
        return x

    def save(signum: int, frame: Any) -> None:
        write_atomically(Path(folder, f"stopping-{name}"), str(signum))
        x, end = 0.0, time.monotonic() + 120
        while not Path(folder, "go").exists() and time.monotonic() < end:
            x = step(x)
        saving = time.monotonic() + 0.5
        while time.monotonic() < saving:
            x = step(x)
        write_atomically(Path(folder, f"saved-{name}"), f"{signum} {x}")
        sys.exit(0)

    signal.signal(signal.SIGTERM, save)
    write_atomically(Path(folder, f"ready-{name}"), str(os.getpid()))
    x, end = 0.0, time.monotonic() + 120
    while time.monotonic() < end:
        x = step(x)


def ranks_that_save_on_sigterm(folder: str) -> None:
    """`distributed.run` on the job's cards, each rank as in `save_on_sigterm`."""
    from levers9 import distributed as dist

    dist.run(_rank_that_saves_on_sigterm, folder)


def _rank_that_saves_on_sigterm(folder: str) -> None:
    from levers9 import distributed as dist

    save_on_sigterm(folder, dist.rank())
