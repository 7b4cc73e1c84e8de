"""`distributed.run`: call fn(cfg) on every rank and return what rank 0 returned.

Not under a launcher, it starts one process per card (or `nprocs`), forked when that is safe (the
fastest start: no second interpreter, no second `import torch`) and as fresh interpreters with fn and
cfg shipped by value when it is not (CUDA already initialised, e.g. in a notebook). The parent hosts
the rendezvous store on a loopback socket it bound itself (port 0: no races, nothing reachable from
other hosts), forwards the ranks' output, and watches every rank: the first failure stops the rest
and is raised here, with the rank, its exit code or signal, and its own traceback.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import inspect
import logging
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from levers9.distributed import _rank, detect, forking, group, stalls, world
from levers9.distributed.detect import LaunchInfo
from levers9.errors import NotShippableError, RankCrashed, RankFailed, RankFailure, RunTimeout, StallError

log = logging.getLogger("levers9.distributed")

STOP_GRACE_S = 2.0  # SIGTERM, then SIGKILL after this long
ROOT_CAUSE_WINDOW_S = 0.15  # after the first failure, wait this long for an earlier one still in flight
OUTPUT_TAIL_LINES = 400  # kept per rank
REPORT_LINES = 40  # shown in a failure report


def run(
    fn: Callable[..., Any],
    cfg: Any = None,
    *,
    nprocs: int | None = None,
    backend: str | None = None,
    timeout: float | None = None,
    stall_timeout: float | None = None,
    start_method: str | None = None,
    prefix_output: bool = True,
    disable_quirks: tuple[str, ...] = (),
) -> Any:
    """Run `fn(cfg)` on every rank and return what rank 0 returned (on every rank, under a launcher).

    Not launched by anything: one process per visible card, or `nprocs` (no card and no `nprocs`:
    run in place as a world of one). Under torchrun / accelerate / SLURM / MPI / levers9: spawn
    nothing; join (or reuse) the process group and call fn. `fn()` is called without an argument
    when `cfg` is None and fn takes no parameters. `timeout` (seconds) stops a run that takes
    longer; `stall_timeout` (seconds) stops a run once no rank issued or completed a collective for
    that long while at least one waited for one, naming the ranks and where each one is (both reports
    carry every rank's Python stack); `start_method` ("fork" or "spawn") overrides the automatic
    choice; `prefix_output` puts "[rank N] " before lines from ranks other than 0.
    """
    _check_callable(fn)
    if stall_timeout is None:
        stall_timeout = _seconds_from_env("LEVERS9_STALL_TIMEOUT")  # set by @job(stall_timeout=...)
    for name, value in (("timeout", timeout), ("stall_timeout", stall_timeout)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"{name}={value!r}; expected a positive number of seconds, or None for no limit.")
    call_without_cfg = cfg is None and _takes_no_arguments(fn)
    info = world.launch_info()
    if info.launcher != "single" or world.live_group() is not None:
        return _run_as_rank(fn, cfg, call_without_cfg, info, backend)
    layout = plan_layout(nprocs, backend)
    if layout.nprocs == 1:
        return _run_in_place(fn, cfg, call_without_cfg, layout.backend)
    return _Spawn(
        fn,
        cfg,
        call_without_cfg,
        layout,
        timeout=timeout,
        stall_timeout=stall_timeout,
        start_method=start_method or os.environ.get("LEVERS9_START_METHOD") or "auto",
        prefix_output=prefix_output,
        disable_quirks=disable_quirks,
    ).run()


@dataclasses.dataclass(frozen=True)
class Layout:
    """How many ranks to start, on which backend, and whether they compute on cards."""

    nprocs: int
    backend: str
    use_cuda: bool
    simulated: bool = False


def visible_card_count() -> int:
    """How many cards this process may use, without initialising CUDA (NVML-based count)."""
    import torch

    if not (torch.version.cuda or getattr(torch.version, "hip", None)):
        return 0
    return int(torch.cuda.device_count())


def plan_layout(nprocs: int | None, backend: str | None) -> Layout:
    """Ranks, backend and device for a run started here; a clear error for impossible combinations."""
    if nprocs is not None and (isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1):
        raise ValueError(f"nprocs={nprocs!r}; expected a whole number >= 1, or None for one rank per visible card.")
    if backend is not None and backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r}; expected 'nccl', 'gloo' or None (nccl on cards, gloo on the CPU).")
    if os.environ.get("LEVERS9_SIMULATED") == "1":
        cards = int(os.environ.get("LEVERS9_GPU_COUNT", "1") or 1)
        return Layout(nprocs or cards, "gloo", use_cuda=False, simulated=True)
    cards = visible_card_count()
    if backend == "gloo" or (cards == 0 and backend is None):
        return Layout(nprocs or 1, "gloo", use_cuda=False)
    if cards == 0:
        raise ValueError(
            "backend='nccl' but this process sees no CUDA card. Expected at least one card; "
            "pass backend='gloo' (or leave backend unset) to run on the CPU."
        )
    if nprocs is not None and nprocs > cards:
        raise ValueError(
            f"nprocs={nprocs} but only {cards} card(s) are visible{group.visible_devices_note()}: ranks {cards}..{nprocs - 1} would "
            f"have no card. Expected one card per rank; pass nprocs<={cards}, or backend='gloo' to run "
            f"{nprocs} ranks on the CPU."
        )
    return Layout(nprocs or cards, "nccl", use_cuda=True)


def _seconds_from_env(name: str) -> float | None:
    """A positive number of seconds from environment variable `name`, or None when it is unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{name}={text!r}; expected a positive number of seconds. Unset it or fix its value.")
    return value


def _check_callable(fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"distributed.run needs a function to call on every rank; got {type(fn).__name__} {fn!r}.")


def _takes_no_arguments(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return not any(p.kind in positional or p.kind == inspect.Parameter.VAR_POSITIONAL for p in params)


def _call(fn: Callable[..., Any], cfg: Any, call_without_cfg: bool) -> Any:
    return fn() if call_without_cfg else fn(cfg)


def _run_as_rank(fn: Callable[..., Any], cfg: Any, call_without_cfg: bool, info: LaunchInfo, backend: str | None) -> Any:
    """Under a launcher (or in a group the user made): join or reuse the group, call fn, share rank 0's value."""
    created = group.join_launcher_group(info, backend=backend)
    try:
        result = _call(fn, cfg, call_without_cfg)
        td = world.live_group()
        if td is None or td.get_world_size() == 1:
            return result
        box = [_rank.to_cpu(result) if td.get_rank() == 0 else None]
        device = None
        if td.get_backend() == "nccl":
            from levers9.distributed.helpers import device as this_device

            device = this_device()
        td.broadcast_object_list(box, src=0, device=device)
        return box[0]
    finally:
        if created:
            group.destroy_own_group()


def _run_in_place(fn: Callable[..., Any], cfg: Any, call_without_cfg: bool, backend: str) -> Any:
    """A world of one: a plain call with quirks applied; no group unless fn makes one (then it is fn's)."""
    group.apply_quirks_here(1, backend)
    try:
        return _call(fn, cfg, call_without_cfg)
    finally:
        group.destroy_own_group()


@dataclasses.dataclass
class _RankProcess:
    """The parent's view of one rank: its process, pipes, output tail and what it reported."""

    rank: int
    pid: int
    popen: subprocess.Popen[bytes] | None
    msg_fd: int
    out_fd: int
    err_fd: int
    reader: _rank.FrameReader = dataclasses.field(default_factory=_rank.FrameReader)
    partial: dict[int, bytes] = dataclasses.field(default_factory=dict)
    tail: collections.deque[str] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=OUTPUT_TAIL_LINES))
    status: tuple[int | None, int | None] | None = None  # (exit code, signal) once reaped
    result: bytes | None = None
    error: _rank.ErrorReport | None = None

    def poll(self) -> bool:
        """Reap the process if it has exited; True once it has."""
        if self.status is not None:
            return True
        if self.popen is not None:
            code = self.popen.poll()
            if code is None:
                return False
            self.status = (code, None) if code >= 0 else (None, -code)
            return True
        try:
            pid, raw = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            self.status = (None, None)
            return True
        if pid == 0:
            return False
        if os.WIFSIGNALED(raw):
            self.status = (None, os.WTERMSIG(raw))
        else:
            self.status = (os.WEXITSTATUS(raw), None)
        return True

    def signal_group(self, signum: int) -> None:
        """Send `signum` to the rank and everything it started (its process group)."""
        if self.status is not None:
            return
        for target in (lambda: os.killpg(self.pid, signum), lambda: os.kill(self.pid, signum)):
            try:
                target()
                return
            except (ProcessLookupError, PermissionError):
                continue


class _Spawn:
    """One spawned run: start the ranks, watch them, return rank 0's value or raise the root failure."""

    def __init__(
        self,
        fn: Callable[..., Any],
        cfg: Any,
        call_without_cfg: bool,
        layout: Layout,
        *,
        timeout: float | None,
        stall_timeout: float | None,
        start_method: str,
        prefix_output: bool,
        disable_quirks: tuple[str, ...],
    ) -> None:
        self.fn, self.cfg, self.call_without_cfg = fn, cfg, call_without_cfg
        self.layout = layout
        self.timeout = timeout
        self.stall_timeout = stall_timeout
        self.folder: stalls.RunFolder | None = None
        self.prefix_output = prefix_output
        self.disable_quirks = disable_quirks
        self.start_method, self.start_reason = self._choose_start_method(start_method)
        self.ranks: list[_RankProcess] = []
        self.selector = selectors.DefaultSelector()
        self.started = time.monotonic()

    @staticmethod
    def _choose_start_method(requested: str) -> tuple[str, str]:
        """The start method, and why ranks cannot be forked when they will be fresh interpreters."""
        if requested not in ("auto", "fork", "spawn"):
            raise ValueError(f"start_method={requested!r}; expected 'fork', 'spawn' or None (automatic).")
        safe, reason = forking.fork_is_safe()
        if requested == "fork" and not safe:
            raise ValueError(f"start_method='fork' is not safe here: {reason}. Pass start_method='spawn' or None.")
        if requested == "spawn":
            return "spawn", "start_method='spawn' was asked for (argument or LEVERS9_START_METHOD)"
        if not safe:
            log.debug("starting ranks as fresh interpreters: %s", reason)
        return ("fork", "") if safe else ("spawn", reason)

    def run(self) -> Any:
        payload = self._payload() if self.start_method == "spawn" else None
        child_env = self._child_env()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        store = None
        self.folder = stalls.RunFolder(self.layout.nprocs)
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(128)
            port = listener.getsockname()[1]
            import torch.distributed as td

            store = td.TCPStore(
                "127.0.0.1",
                port,
                None,
                True,
                datetime.timedelta(seconds=60),
                wait_for_workers=False,
                master_listen_fd=os.dup(listener.fileno()),
            )
            listener.close()
            for rank in range(self.layout.nprocs):
                spec = _rank.RankSpec(
                    rank=rank,
                    world_size=self.layout.nprocs,
                    backend=self.layout.backend,
                    port=port,
                    parent_pid=os.getpid(),
                    env={**child_env, **_rank_env(rank, self.layout.nprocs, port)},
                    call_without_cfg=self.call_without_cfg,
                    run_folder=str(self.folder.path),
                )
                self.ranks.append(self._start(spec, payload))
            self.folder.write_pids(os.getpid(), [p.pid for p in self.ranks])
            return self._watch()
        finally:
            self._stop_all()
            self._close()
            listener.close()
            del store
            self.folder.remove()

    def _payload(self) -> bytes:
        """fn and cfg pickled by value where needed (cloudpickle), or a clear error naming what cannot be."""
        for what, value in (("fn", self.fn), ("cfg", self.cfg)):
            try:
                _rank.ship(value)
            except Exception as exc:
                part = _rank.unpicklable_part(value, what)
                raise NotShippableError(
                    f"{what} must be pickled to reach ranks started as fresh interpreters ({self.start_reason}, "
                    f"so they are not forked), but {part} cannot be: {type(exc).__name__}: {exc}. Expected plain "
                    f"data and importable or notebook-defined functions; pass paths or settings instead of open "
                    f"files, locks or live objects, and open them inside fn."
                ) from exc
        return _rank.ship((self.fn, self.cfg))

    def _child_env(self) -> dict[str, str]:
        """Variables every rank gets on top of the caller's environment (quirk defaults included)."""
        from levers9.distributed import quirks

        plan = quirks.plan_quirks(
            local_world_size=self.layout.nprocs, backend=self.layout.backend, disabled=self.disable_quirks
        )
        plan.raise_errors()  # before any rank starts
        plan.log()
        env: dict[str, str] = {"LEVERS9_QUIRKS_APPLIED": "1", **plan.set_env}
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in os.environ:
                env[name] = "lo"  # one machine: rank-to-rank sockets stay on loopback
        if not self.layout.use_cuda:
            env["LEVERS9_DEVICE"] = "cpu"
        return env

    def _start(self, spec: _rank.RankSpec, payload: bytes | None) -> _RankProcess:
        msg_r, msg_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        popen = None
        try:
            if self.start_method == "fork":
                others = [fd for r in self.ranks for fd in (r.msg_fd, r.out_fd, r.err_fd)]
                _flush_std_streams()
                pid = os.fork()
                if pid == 0:  # the child
                    for fd in (msg_r, out_r, err_r, *others):
                        with contextlib.suppress(OSError):
                            os.close(fd)
                    with contextlib.suppress(Exception):
                        self.selector.close()
                    _rank.forked_child(spec, self.fn, self.cfg, msg_w, out_w, err_w)
                with contextlib.suppress(OSError):
                    os.setpgid(pid, pid)
            else:
                assert payload is not None
                env = {**os.environ, **spec.env, "LEVERS9_MSG_FD": str(msg_w)}
                popen = subprocess.Popen(
                    [sys.executable, "-c", "from levers9.distributed._rank import fresh_child; fresh_child()"],
                    stdin=subprocess.PIPE,
                    stdout=out_w,
                    stderr=err_w,
                    pass_fds=(msg_w,),
                    env=env,
                    start_new_session=True,
                )
                pid = popen.pid
                assert popen.stdin is not None
                with contextlib.suppress(BrokenPipeError):
                    popen.stdin.write(pickle.dumps((list(sys.path), os.getcwd(), spec, payload)))
                    popen.stdin.close()
        finally:
            for fd in (msg_w, out_w, err_w):
                os.close(fd)
        proc = _RankProcess(spec.rank, pid, popen, msg_r, out_r, err_r)
        for fd in (msg_r, out_r, err_r):
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, proc)
        return proc

    def _watch(self) -> Any:
        """Pump messages and output until every rank is done or one fails; then return or raise."""
        deadline = self.started + self.timeout if self.timeout is not None else None
        failure_seen_at: float | None = None
        while True:
            now = time.monotonic()
            wait = 0.05
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - now))
            self._pump(wait)
            exited = [p.poll() for p in self.ranks]  # reap every rank, every round: a crash must be seen
            failed = any((done and p.status != (0, None)) or p.error is not None for done, p in zip(exited, self.ranks, strict=True))
            if failed and failure_seen_at is None:
                failure_seen_at = time.monotonic()
            if failure_seen_at is not None and time.monotonic() - failure_seen_at >= ROOT_CAUSE_WINDOW_S:
                self._raise_root_failure()
            if all(p.status is not None for p in self.ranks) and failure_seen_at is None:
                self._drain()
                return self._rank0_result()
            if deadline is not None and time.monotonic() >= deadline:
                self._raise_timeout()
            if self.stall_timeout is not None and self.folder is not None:
                states, now = self.folder.states(), time.monotonic()
                self.folder.sample_when_quiet(states, now)
                if stalls.stalled(states, self.stall_timeout, now):
                    self._raise_stall()

    def _pump(self, wait: float) -> None:
        """Read whatever is ready: messages go to their rank, output is forwarded line by line."""
        for key, _ in self.selector.select(wait):
            proc: _RankProcess = key.data
            fd = key.fd
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                self.selector.unregister(fd)
                os.close(fd)
                if fd != proc.msg_fd:
                    self._emit(proc, fd, proc.partial.pop(fd, b""), final=True)
                continue
            if fd == proc.msg_fd:
                for message in proc.reader.feed(chunk):
                    self._on_message(proc, message)
            else:
                self._emit(proc, fd, proc.partial.pop(fd, b"") + chunk, final=False)

    def _emit(self, proc: _RankProcess, fd: int, data: bytes, *, final: bool) -> None:
        if not data:
            return
        lines = data.split(b"\n")
        if not final:
            rest = lines.pop()
            if rest:
                proc.partial[fd] = rest
        elif lines and lines[-1] == b"":
            lines.pop()
        stream: TextIO = sys.stdout if fd == proc.out_fd else sys.stderr
        prefix = f"[rank {proc.rank}] " if self.prefix_output and proc.rank != 0 else ""
        text_lines = [line.decode("utf-8", errors="replace") for line in lines]
        proc.tail.extend(text_lines)
        if text_lines:
            stream.write("".join(f"{prefix}{line}\n" for line in text_lines))
            stream.flush()

    def _on_message(self, proc: _RankProcess, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "result":
            proc.result = message[2]
        elif kind == "error":
            proc.error = message[2]

    def _drain(self, seconds: float = 0.5) -> None:
        """Read what is left in the pipes (output written just before exiting)."""
        end = time.monotonic() + seconds
        while self.selector.get_map() and time.monotonic() < end:
            self._pump(0.02)

    def _rank0_result(self) -> Any:
        rank0 = self.ranks[0]
        if rank0.result is None:
            return None
        import cloudpickle

        return cloudpickle.loads(rank0.result)

    def _failure_of(self, proc: _RankProcess) -> RankFailure:
        code, sig = proc.status if proc.status is not None else (None, None)
        report = proc.error
        return RankFailure(
            rank=proc.rank,
            pid=proc.pid,
            exitcode=report.exitcode if report is not None else code,
            signal=sig if report is None else None,
            exc_type=report.exc_type if report is not None and report.exc_type != "SystemExit" else None,
            message=(report.message if report is not None else ""),
            traceback=report.traceback if report is not None else "",
            output_tail=output_excerpt(list(proc.tail)),
        )

    def _root_cause(self) -> _RankProcess:
        """The rank whose failure came first; errors caused only by losing a peer rank last."""
        for proc in self.ranks:
            proc.poll()
        failed = [p for p in self.ranks if p.error is not None or (p.status is not None and p.status != (0, None))]

        def order(proc: _RankProcess) -> tuple[int, float]:
            if proc.error is not None:
                return (1 if proc.error.peer_loss else 0, proc.error.when)
            return (0, time.monotonic())  # a crash: seen now, but never a mere consequence

        return min(failed, key=order)

    def _raise_root_failure(self) -> None:
        root = self._root_cause()
        self._stop_all()
        self._drain(0.3)
        failure = self._failure_of(root)
        report = root.error
        others = [p.rank for p in self.ranks if p is not root]
        stopped = f"; the other rank(s) {', '.join(map(str, others))} were stopped" if others else ""
        headline = f"distributed.run: {failure.describe().splitlines()[0]}{stopped}."
        if report is None:
            hint = ""
            if failure.signal == signal.SIGKILL:
                hint = "\nSIGKILL often means the kernel's out-of-memory killer: check `dmesg` or reduce the batch size."
            raise RankCrashed(f"{headline}\n\n{failure.describe()}{hint}", failure)
        if report.exc_type == "SystemExit":
            raise RankCrashed(
                f"distributed.run: rank {root.rank} (pid {root.pid}) called sys.exit({report.message or report.exitcode}){stopped}.\n\n"
                f"{failure.describe()}",
                failure,
            )
        wrapper = RankFailed(f"{headline}\n\n{failure.describe()}", failure)
        original = _rebuild(report)
        if original is None:
            raise wrapper
        original.add_note(
            f"levers9: raised on rank {root.rank} (pid {root.pid}) of {len(self.ranks)}{stopped}. "
            f"Its traceback:\n{report.traceback.rstrip()}"
        )
        raise original from wrapper

    def _where_ranks_are(self) -> str:
        """Every live rank's collective state and Python stack, asked for now (SIGUSR1 to each)."""
        assert self.folder is not None
        live = {p.rank: p.pid for p in self.ranks if not p.poll()}
        states = self.folder.fresh_states(list(live))
        dumps = stalls.collect_stacks(live, self.folder.path)
        return stalls.describe_ranks(states, dumps, time.monotonic())

    def _output_tails(self, lines: int = 10) -> str:
        return "".join(
            f"\n\nLast output of rank {p.rank}:\n" + "\n".join(list(p.tail)[-lines:]) for p in self.ranks if p.tail
        )

    def _stop_with_report(self) -> str:
        """Ask every rank where it is, stop them all, and return that report with their last output."""
        where = self._where_ranks_are()
        self._stop_all()
        self._drain(0.3)
        return where + self._output_tails()

    def _raise_timeout(self) -> None:
        running = [p.rank for p in self.ranks if not p.poll()]
        where = self._stop_with_report()
        raise RunTimeout(
            f"distributed.run timed out: still running after {self.timeout:g} s (timeout={self.timeout:g}); "
            f"rank(s) {', '.join(map(str, running))} had not finished and every rank was stopped. Expected the "
            f"run to finish within the timeout; pass a larger timeout=, or None for no limit. Where each rank "
            f"was:\n{where}"
        )

    def _raise_stall(self) -> None:
        where = self._stop_with_report()
        raise StallError(
            f"distributed.run stalled: for {self.stall_timeout:g} s (stall_timeout={self.stall_timeout:g}) no "
            f"rank issued or completed a collective while at least one waited for one; every rank was stopped. "
            f"The rank that is not waiting, or issued fewer collectives, is usually the cause: a skipped "
            f"collective, uneven data, or a loader that hangs. Pass a larger stall_timeout= if a step "
            f"legitimately takes longer.\n{where}"
        )

    def _stop_all(self) -> None:
        """SIGTERM every live rank's process group, SIGKILL after a grace period, and reap them all."""
        live = [p for p in self.ranks if not p.poll()]
        for proc in live:
            proc.signal_group(signal.SIGTERM)
        end = time.monotonic() + STOP_GRACE_S
        while live and time.monotonic() < end:
            self._pump(0.02)
            live = [p for p in live if not p.poll()]
        for proc in live:
            proc.signal_group(signal.SIGKILL)
        for proc in live:
            while not proc.poll():
                time.sleep(0.01)
        for proc in self.ranks:  # grandchildren left in a rank's process group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def _close(self) -> None:
        for key in list(self.selector.get_map().values()):
            with contextlib.suppress(OSError):
                os.close(key.fd)
        self.selector.close()


def output_excerpt(lines: list[str]) -> str:
    """The part of a rank's last output worth showing: a fatal-error stack dump if there is one, else the last lines."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
    if starts:
        return "\n".join(lines[starts[-1] : starts[-1] + REPORT_LINES])
    return "\n".join(lines[-REPORT_LINES:])


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables a rank of a one-node run gets: those torchrun's agent gives a worker, plus levers9's own.

    MASTER_ADDR/MASTER_PORT name the store the parent hosts, and TORCHELASTIC_USE_AGENT_STORE=True
    makes torch's env:// rendezvous join it as a client on every rank (rank 0 included), as under
    torchrun; TORCHELASTIC_RUN_ID makes torch.distributed.is_torchelastic_launched() answer True.
    """
    return {
        "LEVERS9_LAUNCHER": "levers9",
        group.STORE_PORT_VAR: str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "NODE_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": f"{detect.LEVERS9_RUN_ID_PREFIX}{os.getpid()}-{port}",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def _rebuild(report: _rank.ErrorReport) -> BaseException | None:
    """The rank's original exception object, if it unpickles here."""
    if report.exc_blob is None:
        return None
    try:
        exc = pickle.loads(report.exc_blob)
    except Exception:
        return None
    return exc if isinstance(exc, BaseException) else None


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()

