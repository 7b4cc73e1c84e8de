"""Parent side: children's output cut into lines, and handed to the caller's callback on a thread of its own.

Cutting costs time linear in what was read, however long a line is: the bytes of an unfinished line are kept
as a list of chunks and joined once. A line longer than PIECE_BYTES is handed on in pieces of about that size,
so no copy of it is ever held whole. The Forwarder calls the callback in order on its own thread and holds at
most QUEUE_BYTES: the watcher stops reading children's output while it is full (the children then block on a
full pipe, as torchrun's workers do on a full stdout), and never blocks itself on a caller's stream that takes
nothing, so exits, messages and deadlines are still seen.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

PIECE_BYTES = 1 << 20  # an unfinished line is handed on once this much of it is held
HOLD_S = 0.05  # a redraw ("\r"), or with `immediate` any unfinished line, is handed on once held this long
QUEUE_BYTES = 4 << 20  # output read but not yet taken by the callback; reading pauses above it
IDLE_S = 1.0  # a forwarder thread with nothing to do for this long ends (the next piece starts another)

TextSink = Callable[[Any, str, str], None]  # (child, "stdout" or "stderr", text): a line or a piece of one


class LineCutter:
    """One pipe's bytes as text pieces: each finished line whole, with its "\\n"; a line longer than
    PIECE_BYTES in pieces without one until its last; an unfinished line that redraws itself with a "\\r" (a
    progress bar), and with `immediate` any unfinished line (a prompt), as far as it goes once HOLD_S passed
    after its first held byte, as a terminal shows it (so a line written in a few quick writes is still one
    piece, and on a pipe or a file a line without "\\r" is still never split); undecodable bytes replaced, or
    kept as surrogates (`exact`) that `echo.write` turns back into the same bytes."""

    def __init__(self, *, immediate: bool = False, exact: bool = False) -> None:
        self._held: list[bytes] = []
        self._size = 0
        self._open = False  # a piece of the unfinished line was handed on already
        self._immediate = immediate
        self._held_since: float | None = None  # when the unfinished line's first held byte came
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape" if exact else "replace")

    def feed(self, data: bytes) -> list[str]:
        """The pieces that `data` finishes (in order)."""
        pieces: list[str] = []
        end = data.rfind(b"\n") + 1
        if end:
            head = b"".join([*self._held, data[:end]])
            self._held, self._size, self._held_since, self._open = [], 0, None, False
            lines = self._decoder.decode(head).split("\n")
            pieces.extend(line + "\n" for line in lines[:-1])  # the last is "": head ends with a newline
            data = data[end:]
        if data:
            self._held.append(data)
            self._size += len(data)
            if self._size >= PIECE_BYTES:
                pieces.append(self._piece())
            elif self._held_since is None and (self._immediate or b"\r" in data):
                self._held_since = time.monotonic()
        return [p for p in pieces if p]

    def end(self) -> list[str]:
        """At end of file: what is left, as a finished line (or nothing, if nothing is left)."""
        text = self._decoder.decode(b"".join(self._held), final=True)
        self._held, self._size = [], 0
        was_open, self._open = self._open, False
        return [text + "\n"] if text or was_open else []

    @property
    def holding(self) -> bool:
        """True while an unfinished line waits for `due` (a redraw, or any line of an immediate cutter)."""
        return self._held_since is not None

    def due(self, now: float) -> list[str]:
        """The unfinished line so far, once it has been held HOLD_S."""
        if self._held_since is None or now - self._held_since < HOLD_S:
            return []
        piece = self._piece()
        return [piece] if piece else []

    def _piece(self) -> str:
        text = self._decoder.decode(b"".join(self._held))
        self._held, self._size, self._held_since = [], 0, None
        self._open = self._open or bool(text)
        return text


class WholeLines:
    """A TextSink that joins pieces into lines for a callback that takes whole lines without their "\\n"
    (it then holds a long line whole, once; linear in its length)."""

    def __init__(self, on_line: Callable[[Any, str, str], None]) -> None:
        self.on_line = on_line
        self._open: dict[tuple[Any, str], list[str]] = {}

    def __call__(self, child: Any, stream: str, text: str) -> None:
        if not text.endswith("\n"):
            self._open.setdefault((child, stream), []).append(text)
            return
        held = self._open.pop((child, stream), [])
        held.append(text[:-1])
        line = "".join(held)
        held.clear()  # the pieces go before the callback runs: a long line is held once, not twice
        self.on_line(child, stream, line)


class Forwarder:
    """Calls `sink` with each piece put here, in order, on a thread of its own; at most QUEUE_BYTES wait.

    `wake_fd` gets a byte whenever room is made after `full` was seen true, so a watcher that stopped
    reading can wait on it. An exception from `sink` is kept and raised by the next `put` or `check`.
    """

    def __init__(self, sink: TextSink, wake_fd: int) -> None:
        self.sink, self.wake_fd = sink, wake_fd
        self._items: collections.deque[tuple[Any, str, str]] = collections.deque()
        self._bytes = 0
        self._busy = False  # a sink call is in progress
        self._dropped = False  # close gave up on a sink that took nothing: the rest is dropped
        self._wanted_room = False
        self._progress = time.monotonic()  # when the sink last returned
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def full(self) -> bool:
        """True while QUEUE_BYTES or more wait; the next room made is signalled on `wake_fd`."""
        with self._cond:
            if self._bytes < QUEUE_BYTES:
                return False
            self._wanted_room = True
            return True

    @property
    def waiting(self) -> int:
        """Characters put here and not yet handed to the sink."""
        with self._cond:
            return self._bytes

    def put(self, child: Any, stream: str, text: str) -> None:
        """Queue one piece (never blocks)."""
        self.check()
        with self._cond:
            if self._dropped:
                return
            self._items.append((child, stream, text))
            self._bytes += len(text)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="levers9-output", daemon=False)
                self._thread.start()
            self._cond.notify_all()

    def check(self) -> None:
        """Raise what the sink raised, once."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def flush(self, stuck_s: float | None) -> bool:
        """Wait until every piece was handed to the sink; with `stuck_s`, give up once the sink has taken
        nothing for that long (a caller's stream nobody reads). True if everything was handed on."""
        with self._cond:
            while self._items or self._busy:
                if stuck_s is None:
                    self._cond.wait()
                    continue
                left = self._progress + stuck_s - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, stuck_s: float | None) -> bool:
        """flush(stuck_s), then drop whatever is left: the sink is not called again after the call it may
        be stuck in. True if everything was handed on."""
        done = self.flush(stuck_s)
        with self._cond:
            self._dropped = True
            self._items.clear()
            self._bytes = 0
            self._cond.notify_all()
        return done

    def _serve(self) -> None:
        while True:
            with self._cond:
                if not self._items:
                    self._cond.wait_for(lambda: bool(self._items) or self._dropped, IDLE_S)
                if not self._items:
                    self._thread = None
                    return
                child, stream, text = self._items.popleft()
                self._busy = True
            try:
                self.sink(child, stream, text)
            except BaseException as exc:  # noqa: BLE001 - raised on the watcher's thread by check()
                self._error = self._error or exc
            finally:
                with self._cond:
                    self._busy = False
                    self._bytes = max(0, self._bytes - len(text))
                    self._progress = time.monotonic()
                    if self._wanted_room and not self._dropped and self._bytes < QUEUE_BYTES // 2:
                        self._wanted_room = False
                        with contextlib.suppress(OSError):  # a full pipe: the watcher is awake already
                            os.write(self.wake_fd, b"\0")  # under the lock: close() closes it only after _dropped
                    self._cond.notify_all()
