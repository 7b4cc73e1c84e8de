"""What the caller sees while a batch runs: each job's output with its cell as prefix, and the sweep's state.

Job output goes to the caller's stream the job wrote to, as `[train #3] line`. A sweep (a map of more
than one cell) shows its state on stderr: on a terminal, a status table redrawn in place, with job output
scrolling above it; elsewhere (CI, a batch system, a pipe), one plain line per state change;
with progress=False, neither (job output still streams unless stream_output=False).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import Literal, TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from levers9.errors import first_line
from levers9.launch.backend import Batch
from levers9.launch.cells import Cell
from levers9.launch.run_reader import CellState
from levers9.procs import echo
from levers9.procs.echo import LabelledOutput
from levers9.procs.watch import cut_line
from levers9.seconds import say_duration

log = logging.getLogger("levers9.launch")

TABLE_ROWS = 20  # sweeps up to this many cells get one row per cell; larger ones group their cells
FAILED_ROWS = 5  # failed cells shown by name in a grouped table (the latest ones)
Mode = Literal["table", "lines", "off"]


@dataclasses.dataclass
class _CellView(CellState):
    """A cell's row in the live table: its state as the run record keeps it (started and ended on the
    monotonic clock here), and the last line it printed, or why it waits, or its error."""

    last: str = ""


def choose_mode(progress: bool, cells: int, stream: TextIO) -> Mode:
    """'table' on a terminal, 'lines' elsewhere, 'off' for progress=False or a single cell."""
    if not progress or cells <= 1:
        return "off"
    return "table" if echo.isatty(stream) else "lines"


class Reporter:
    """The Events of one batch as the caller sees them: prefixed output, and the table or the lines."""

    def __init__(
        self, batch_label: str, cells: Sequence[Cell], *, mode: Mode = "off", stream_output: bool = True
    ) -> None:
        self.batch: Batch | None = None
        self.label = batch_label
        self.mode = mode
        self.stream_output = stream_output  # False: output lines only feed the table's last-output column
        self._cells = {cell.index: _CellView(cell.index, cell.describe()) for cell in cells}
        self.total = len(cells)
        self.done = 0
        self.failed = 0
        self.reused = 0
        self.start = time.monotonic()
        self._lock = threading.RLock()
        self._out = LabelledOutput(redraws=False)
        self._live: Live | None = None
        if mode == "table":
            console = Console(file=sys.stderr)
            self._live = Live(console=console, get_renderable=self._render, refresh_per_second=4, transient=False)
            self._live.start()

    @property
    def running(self) -> int:
        """Cells started and not yet finished (a retried cell counts once)."""
        return sum(v.state in ("running", "retrying") for v in self._cells.values())

    def _name(self, cell: Cell) -> str:
        return self.batch.cell_label(cell) if self.batch is not None else f"{self.label} #{cell.index}"

    def note(self, text: str) -> None:
        """One line about the whole sweep (above the table, as a plain line, or to the log)."""
        if self.mode == "off":
            log.info("%s", text)
        else:
            self._line(f"levers9: {self.label}: {text}")

    def reused_cell(self, cell: Cell) -> None:
        """`cell` was not run: its result came from an earlier run."""
        with self._lock:
            self._cells[cell.index].state = "reused"
            self.done += 1
            self.reused += 1

    def waiting(self, cell: Cell, why: str) -> None:
        """`cell` has not started, for the reason `why` (in words); said once per new reason."""
        with self._lock:
            view = self._cells.get(cell.index)
            if view is None or view.state != "waiting" or view.last == why:
                return
            view.last = why
        self._change(cell, why)

    def started(self, cell: Cell, cards: str, attempt: int) -> None:
        with self._lock:
            view = self._cells[cell.index]  # every cell of the batch has its row
            view.state, view.card, view.attempt, view.started = "running", cards, attempt, time.monotonic()
        self._change(cell, f"running on {_cards(cards)}" + (f" (attempt {attempt})" if attempt > 1 else ""))

    def retrying(self, cell: Cell, attempt: int, reason: str) -> None:
        with self._lock:
            view = self._cells[cell.index]
            view.state, view.attempt = "retrying", attempt
        self._change(cell, f"retrying after a {reason} (attempt {attempt} next)")

    def finished(self, cell: Cell, ok: bool, error: BaseException | None = None) -> None:
        with self._lock:
            view = self._cells[cell.index]
            view.state = "done" if ok else "failed"
            view.ended = time.monotonic()
            self.done += 1
            self.failed += not ok
            if error is not None:
                view.last = first_line(f"{type(error).__name__}: {error}")
            took = "" if view.took is None else f" in {view.took:.1f} s"
            what = f"done{took}" if ok else f"failed{took}: {view.last}"
            summary = f"[{self.done - self.failed}/{self.total} done, {self.failed} failed]"
        self._change(cell, f"{what}  {summary}")

    def output(self, cell: Cell, stream: str, text: str) -> None:
        """A line of a cell's output with its "\\n", or a piece of a long one: "[cell] " before each line."""
        with self._lock:
            view = self._cells.get(cell.index)
            if view is not None and text.strip():
                view.last = cut_line(text.strip())
        if self.stream_output:
            self._out(cell.index, f"[{self._name(cell)}] ", stream, text)

    def close(self) -> None:
        """Draw the final state and stop redrawing (idempotent)."""
        with self._lock:
            live, self._live = self._live, None
        if live is not None:
            live.refresh()
            live.stop()
        self.mode = "off"

    def _change(self, cell: Cell, text: str) -> None:
        if self.mode == "lines":
            self._line(f"levers9: {self._name(cell)} {_short(self._cells[cell.index].args)}: {text}")

    def _line(self, text: str) -> None:
        live = self._live
        if live is not None:
            live.console.print(Text(text))
        else:
            echo.write("stderr", text + "\n")

    # ---- the table ----

    def _render(self) -> RenderableType:
        with self._lock:
            views = list(self._cells.values())
            table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
            for column in ("cell", "arguments", "state", "card", "elapsed", "last output"):
                table.add_column(column, no_wrap=True, overflow="ellipsis", max_width=60 if column == "last output" else 30)
            now = time.monotonic()
            if len(views) <= TABLE_ROWS:
                for view in views:
                    table.add_row(*self._row(view, now))
            else:
                self._grouped_rows(table, views, now)
            return Group(table, Text(self._summary(now), style="bold"))

    def _row(self, view: _CellView, now: float) -> tuple[str, ...]:
        if view.took is not None:
            elapsed = f"{view.took:.1f}s"
        elif view.started is not None and view.state in ("running", "retrying"):
            elapsed = f"{now - view.started:.1f}s"
        else:
            elapsed = ""
        state = view.state if view.attempt <= 1 else f"{view.state} (attempt {view.attempt})"
        return (f"#{view.index}", view.args, state, view.card, elapsed, view.last)

    def _grouped_rows(self, table: Table, views: list[_CellView], now: float) -> None:
        for view in views:
            if view.state in ("running", "retrying"):
                table.add_row(*self._row(view, now))
        failed = [v for v in views if v.state == "failed"]
        for view in failed[-FAILED_ROWS:]:
            table.add_row(*self._row(view, now))
        if len(failed) > FAILED_ROWS:
            table.add_row("", f"... and {len(failed) - FAILED_ROWS} more failed", "failed", "", "", "")
        for state in ("waiting", "done", "reused"):
            group = [v.index for v in views if v.state == state]
            if group:
                table.add_row(_span(group), f"{len(group)} cells", state, "", "", "")

    def _summary(self, now: float) -> str:
        elapsed = now - self.start
        ran = self.done - self.reused
        waiting = self.total - self.done - self.running
        left = ""
        if 0 < ran and self.done < self.total:
            left = f", about {say_duration(elapsed / ran * (self.total - self.done))} left"
        return (
            f"{self.label}: {self.done - self.failed} done, {self.failed} failed, {self.running} running, "
            f"{waiting} waiting of {self.total}  [{say_duration(elapsed)}{left}]"
        )


def _cards(cards: str) -> str:
    if cards in ("", "no card") or cards.startswith("no card "):
        return cards or "no card"
    return f"card {cards}" if "," not in cards and " " not in cards else f"cards {cards}"


def _span(indices: list[int]) -> str:
    return f"#{indices[0]}" if len(indices) == 1 else f"#{indices[0]}..#{indices[-1]}"


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
