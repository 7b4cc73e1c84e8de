"""What crosses the process boundary, on both sides: framed messages, a failure record, values shipped.

A child talks to its parent over one pipe, in length-prefixed pickled messages:
    ("result", bytes | None)     the target returned (its value shipped, or None when not asked for)
    ("error", FailureRecord)           the target raised, called sys.exit(non-zero), or its value could not be shipped
    ("waiting", [names])         after either: it waits for these non-daemon threads before it exits
The parent reads them with a FrameReader as they arrive; `rebuild` turns a FailureRecord back into the
original exception where its type can be unpickled here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import os
import pickle
import resource
import struct
import sys
import time
import traceback
import types
from typing import Any, NoReturn

from levers9.errors import NotShippableError, RankFailed, add_note

_HEADER = struct.Struct("!Q")

# Errors a child raises only because a peer died first: never the root cause when a real one exists.
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
# Words of errors a faulty card raises (CUDA reports them as RuntimeError): a crash, not the user's bug.
CARD_FAULT_MARKERS = ("uncorrectable ECC error", "GPU has fallen off the bus", "GPU is lost")


@dataclasses.dataclass(frozen=True)
class FailureRecord:
    """A child's failure as it crosses the pipe: the exception (pickled if it can be), its traceback with
    the cause chain, when it happened, and the exit code the child leaves with. `peer_loss` and
    `card_fault` are read from the live exception's words (torch and CUDA give nothing else), once, here."""

    exc_blob: bytes | None
    exc_type: str
    message: str
    traceback: str
    when: float
    peer_loss: bool
    exitcode: int = 1
    card_fault: bool = False

    @property
    def is_exit(self) -> bool:
        """True when the child called sys.exit(non-zero) rather than raising."""
        return self.exc_type == "SystemExit"


def capture(exc: BaseException, exitcode: int = 1) -> FailureRecord:
    """The FailureRecord for `exc`, pickling the exception itself when that works; a process or thread that could
    not be started is named as such below its traceback (`process_limit_note`)."""
    try:
        blob: bytes | None = ship(exc)
    except Exception:
        blob = None
    message = describe(exc)
    limit = process_limit_note(exc)
    return FailureRecord(
        exc_blob=blob,
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        message=message,
        traceback="".join(traceback.format_exception(type(exc), exc, user_frames(exc.__traceback__)))
        + (f"{limit}\n" if limit else ""),
        when=time.monotonic(),
        peer_loss=any(marker in message for marker in PEER_LOSS_MARKERS),
        exitcode=exitcode,
        card_fault=any(marker in message for marker in CARD_FAULT_MARKERS),
    )


# What a process or thread that could not be started raises: fork() and clone() fail with EAGAIN at the limit on a
# user's processes and threads (RLIMIT_NPROC, `ulimit -u`) or the cgroup's (pids.max); Python's threading says so in
# words, and torch's C++ threads (gloo's) as std::system_error's words.
_NO_NEW_TASK_WORDS = ("can't start new thread", "Resource temporarily unavailable")


def process_limit_note(exc: BaseException) -> str:
    """For an exception that says a process or thread could not be started (EAGAIN), what to do about it: the limit
    on this user's processes and threads (`ulimit -u`), or the container's; "" for any other exception."""
    if isinstance(exc, OSError):
        if exc.errno != errno.EAGAIN:
            return ""
    elif not isinstance(exc, RuntimeError) or not any(words in describe(exc) for words in _NO_NEW_TASK_WORDS):
        return ""
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft == resource.RLIM_INFINITY:
        seen = "this user has no limit on processes (ulimit -u), so the limit is probably the container's (cgroup pids.max)"
        fix = "raise the container's limit (docker run --pids-limit, Kubernetes' pod pid limit)"
    else:
        seen = f"this user may run at most {soft} processes and threads together (ulimit -u {soft}), and every rank starts several"
        fix = f"raise it in the shell that starts the run (`ulimit -u {max(4 * soft, 4096)}`, or `ulimit -u unlimited`; a container's `--ulimit nproc=`)"
    return (f"levers9: a process or thread could not be started ({type(exc).__name__}: {describe(exc)}): {seen}. "
            f"Expected room for every rank and the threads torch starts in it; {fix}, or start fewer ranks (nprocs=).")


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """`tb` without its leading frames of levers9's own (the layers that called the user's code); the last
    frame is always kept, so an error levers9 itself raised still says where."""
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        tb = tb.tb_next
    return tb


def describe(exc: BaseException) -> str:
    """str(exc); where that raises (a broken __str__), words saying so, so that the type and traceback still
    reach the caller."""
    try:
        return str(exc)
    except Exception as inner:
        return f"<str() of this {type(exc).__name__} raised {type(inner).__name__}: {describe(inner)}>"


def exit_status(exc: SystemExit) -> int:
    """The status a process leaves with after `exc`, as Python's own exit rules give it (a code that is not
    a number is printed to stderr, and the status is 1)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def rebuild(failure: FailureRecord) -> BaseException | None:
    """The child's original exception object, if it unpickles here."""
    if failure.exc_blob is None:
        return None
    try:
        exc = pickle.loads(failure.exc_blob)
    except Exception:
        return None
    return exc if isinstance(exc, BaseException) else None


def raise_rank_exception(message: str, failure: Any, report: FailureRecord, note: str, beside_note: str | None = None) -> NoReturn:
    """Raise the rank's own exception, rebuilt here, with `note` (its traceback) added and a RankFailed(`beside_note`,
    `failure`) as its cause (`message` where None: what the note does not say, so each traceback is printed once);
    RankFailed(`message`, `failure`) itself where the exception's type cannot be rebuilt in this process."""
    original = rebuild(report)
    if not isinstance(original, Exception):  # not rebuilt, or a KeyboardInterrupt sent to that rank alone: the
        raise RankFailed(message, failure)  # caller was not interrupted, and `except Exception` must catch the rank's failure
    add_note(original, note)
    if beside_note is None or sys.version_info < (3, 11):  # 3.10 prints no notes: there the cause says it all
        beside_note = message
    raise original from RankFailed(beside_note, failure)


def send(fd: int, message: tuple[Any, ...]) -> None:
    """Write one framed message (blocking until it is all written)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


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


def ship(value: Any) -> bytes:
    """`value` pickled by value where needed (cloudpickle), refusing open files (which cloudpickle would
    silently replace by a copy of their contents) so the receiver never gets something else than it expects."""
    import cloudpickle

    class _Shipper(cloudpickle.CloudPickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, io.IOBase) and not isinstance(obj, (io.StringIO, io.BytesIO)):
                raise pickle.PicklingError(f"an open file ({getattr(obj, 'name', type(obj).__name__)!r}) cannot be shipped")
            compact = compact_view(obj)
            return compact if compact is not NotImplemented else super().reducer_override(obj)

    buffer = io.BytesIO()
    _Shipper(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def ship_value(value: Any, what: str) -> bytes:
    """A target's return value shipped for the caller, or NotShippableError naming the part that cannot be pickled.
    Plain data goes through the standard pickle (neither side pays for importing cloudpickle), a tensor viewing a
    small part of a large storage as that part only (`compact_view`); what pickle cannot take by reference (a
    function or class defined in the child) goes by value (`ship`)."""
    with contextlib.suppress(Exception):
        if "torch" not in sys.modules:
            return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        buffer = io.BytesIO()
        _Compact(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        return buffer.getvalue()
    try:
        return ship(value)
    except Exception as exc:
        raise NotShippableError(
            f"{what} cannot be pickled to reach the caller: {unpicklable_part(value)} ({type(exc).__name__}: "
            f"{exc}). Expected plain data (numbers, strings, lists, dicts, CPU tensors); return that instead, "
            f"e.g. a dict of metrics, and save models or large data to disk and return the path."
        ) from exc


def compact_view(obj: Any) -> Any:
    """For a tensor that views a small part of a much larger storage (`big[:10]`), the reduction of a
    copy of just that part (pickle would ship the whole storage); NotImplemented for anything else."""
    torch = sys.modules.get("torch")
    if torch is None or type(obj) is not torch.Tensor or obj.layout != torch.strided:
        return NotImplemented
    try:
        needed = obj.numel() * obj.element_size()
        if obj.untyped_storage().nbytes() <= 2 * needed + 4096:
            return NotImplemented
        copy = obj.detach().clone(memory_format=torch.contiguous_format).requires_grad_(obj.requires_grad)
    except Exception:  # a tensor without a plain storage (meta, functional, ...): pickled as it is
        return NotImplemented
    return copy.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


class _Compact(pickle.Pickler):
    """The standard pickle, except that a tensor viewing a small part of a large storage ships only that part."""

    def reducer_override(self, obj: Any) -> Any:
        return compact_view(obj)


def unship(blob: bytes) -> Any:
    """The value `ship` packed."""
    return pickle.loads(blob)


def unship_value(blob: bytes | None, what: str) -> Any:
    """A target's return value as the caller unpickles it (None for None), or NotShippableError naming
    `what` ("rank 0's return value") and why it cannot be rebuilt here (a module only the child imported)."""
    if blob is None:
        return None
    try:
        return pickle.loads(blob)
    except Exception as exc:
        missing = f" (module {exc.name!r} was imported there, not in this process)" if isinstance(exc, ImportError) and exc.name else ""
        raise NotShippableError(
            f"{what} arrived but cannot be unpickled in the caller: {type(exc).__name__}: {describe(exc)}{missing}. "
            f"Expected a value built from types the caller can import; import that module in the caller too, or "
            f"return plain data (numbers, strings, lists, dicts, tensors)."
        ) from exc


def unpicklable_part(value: Any, path: str = "result") -> str:
    """A description of the first part of `value` that cannot be pickled, e.g. "result['log'] (a TextIOWrapper)"."""
    items: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        items = [(f"{path}[{key!r}]", item) for key, item in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
    for where, item in items:
        try:
            ship(item)
        except Exception:
            return unpicklable_part(item, where)
    return f"{path} (a {type(value).__module__}.{type(value).__qualname__})"
