"""What runs inside each rank that `distributed.run` started: call fn (the group is made lazily), report back.

A rank talks to its parent over one pipe, in length-prefixed pickled messages:
    ("result", rank, bytes | None)       fn returned (rank 0 sends its pickled value)
    ("error", rank, ErrorReport)         fn raised, called sys.exit(non-zero), or its result could not be pickled
Its stdout and stderr are pipes too; the parent forwards them and keeps their last lines.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import io
import os
import pickle
import signal
import struct
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from levers9.distributed import forking, group, stalls

_HEADER = struct.Struct("!Q")

# Errors a rank raises only because another rank died first: never the root cause when a real one exists.
PEER_LOSS_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "communicator was aborted",
    "NCCL communicator",
    "Socket Timeout",
    "failed to recv",
    "Connection refused",
)


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to know about its place, given by the parent."""

    rank: int
    world_size: int
    backend: str
    port: int
    parent_pid: int
    env: dict[str, str]
    call_without_cfg: bool
    run_folder: str
    pg_timeout: float | None = None


@dataclasses.dataclass(frozen=True)
class ErrorReport:
    """A rank's failure as it crosses the pipe: the exception (pickled if it can be) and its traceback text."""

    exc_blob: bytes | None
    exc_type: str
    message: str
    traceback: str
    when: float
    peer_loss: bool
    exitcode: int = 1


def send(fd: int, message: tuple[Any, ...]) -> None:
    """Write one framed message to the parent (blocking until it is all written)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class FrameReader:
    """Reassembles framed messages from the chunks a non-blocking read returns."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[tuple[Any, ...]]:
        """Add `chunk`; return every message now complete."""
        self._buffer += chunk
        messages = []
        while len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            if len(self._buffer) < _HEADER.size + length:
                break
            body = bytes(self._buffer[_HEADER.size : _HEADER.size + length])
            del self._buffer[: _HEADER.size + length]
            messages.append(pickle.loads(body))
        return messages


def to_cpu(value: Any) -> Any:
    """`value` with every tensor inside dicts, lists and tuples moved to the CPU (the parent must not touch CUDA)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)((k, to_cpu(v)) for k, v in value.items()) if type(value) is dict else value
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(to_cpu(v) for v in value)
    return value


def unpicklable_part(value: Any, path: str = "result") -> str:
    """A description of the first part of `value` that cannot be pickled, e.g. "result['log'] (a TextIOWrapper)"."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not _picklable(item):
                return unpicklable_part(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if not _picklable(item):
                return unpicklable_part(item, f"{path}[{i}]")
    return f"{path} (a {type(value).__module__}.{type(value).__qualname__})"


def ship(value: Any) -> bytes:
    """`value` pickled by value where needed (cloudpickle), refusing open files (which cloudpickle would
    silently replace by a copy of their contents) so the receiver never gets something else than it expects."""
    import cloudpickle

    class _Shipper(cloudpickle.CloudPickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, io.IOBase) and not isinstance(obj, (io.StringIO, io.BytesIO)):
                raise pickle.PicklingError(f"an open file ({getattr(obj, 'name', type(obj).__name__)!r}) cannot be shipped")
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    _Shipper(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def _picklable(value: Any) -> bool:
    try:
        ship(value)
        return True
    except Exception:
        return False


def report_for(exc: BaseException, exitcode: int = 1) -> ErrorReport:
    """An ErrorReport for `exc`, pickling the exception itself when that works."""
    import cloudpickle

    try:
        blob: bytes | None = cloudpickle.dumps(exc)
    except Exception:
        blob = None
    text = "".join(traceback.format_exception(exc))
    message = str(exc)
    return ErrorReport(
        exc_blob=blob,
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        message=message,
        traceback=text,
        when=time.monotonic(),
        peer_loss=any(marker in message for marker in PEER_LOSS_MARKERS),
        exitcode=exitcode,
    )


def _redirect_stdio(out_fd: int, err_fd: int) -> None:
    """Point fds 1 and 2 at the parent's pipes, and give Python fresh line-buffered writers on them."""
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    if out_fd > 2:
        os.close(out_fd)
    if err_fd > 2 and err_fd != out_fd:
        os.close(err_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))


def rank_main(spec: RankSpec, fn: Callable[..., Any], cfg: Any, msg_fd: int) -> int:
    """Run one rank to completion; returns the exit status for os._exit."""
    os.environ.update(spec.env)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    status = 0
    try:
        stalls.enable_stack_dumps(spec.run_folder, spec.rank)
        slot = stalls.RankSlot(spec.run_folder, spec.rank)
        stalls.instrument_collectives(slot)
        stalls.start_recorder_sampler(slot, spec.run_folder, spec.rank)
        # No group yet: fn may create it (init_process_group joins the parent's store), else
        # it is created on first need (a levers9 helper or a torch.distributed collective).
        group.prepare_lazy_group(slot)
        result = fn() if spec.call_without_cfg else fn(cfg)
        payload = None
        if spec.rank == 0:
            result = to_cpu(result)
            try:
                payload = ship(result)
            except Exception as exc:
                from levers9.errors import NotShippableError

                raise NotShippableError(
                    f"rank 0's return value cannot be pickled to reach the caller: {unpicklable_part(result)} "
                    f"({type(exc).__name__}: {exc}). Expected plain data (numbers, strings, lists, dicts, CPU "
                    f"tensors); return that instead, e.g. a dict of metrics, and save models to disk."
                ) from exc
        send(msg_fd, ("result", spec.rank, payload))
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            send(msg_fd, ("result", spec.rank, None))
        else:
            status = code if isinstance(code, int) else 1
            if not isinstance(code, int):
                print(code, file=sys.stderr)
            send(msg_fd, ("error", spec.rank, report_for(exc, exitcode=status)))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        status = 1
        send(msg_fd, ("error", spec.rank, report_for(exc)))
    finally:
        _leave_group()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    return status


def _leave_group() -> None:
    try:
        group.destroy_own_group()
    except Exception:
        pass


def forked_child(spec: RankSpec, fn: Callable[..., Any], cfg: Any, msg_fd: int, out_fd: int, err_fd: int) -> None:
    """Entry point right after os.fork(): never returns."""
    status = 70
    try:
        os.setpgid(0, 0)
        forking.die_with_parent(spec.parent_pid)
        _redirect_stdio(out_fd, err_fd)
        status = rank_main(spec, fn, cfg, msg_fd)
    finally:
        os._exit(status)


def fresh_child() -> None:
    """Entry point of a rank started as a fresh interpreter: the payload arrives on stdin."""
    spec_sys_path, cwd, spec, blob = pickle.loads(sys.stdin.buffer.read())
    msg_fd = int(os.environ["LEVERS9_MSG_FD"])
    forking.die_with_parent(spec.parent_pid)
    sys.path[:] = spec_sys_path
    try:
        os.chdir(cwd)
    except OSError:
        pass
    status = 1
    try:
        import cloudpickle

        fn, cfg = cloudpickle.loads(blob)
    except BaseException as exc:  # noqa: BLE001
        send(msg_fd, ("error", spec.rank, report_for(exc)))
    else:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        status = rank_main(spec, fn, cfg, msg_fd)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
