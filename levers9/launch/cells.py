"""Map cells: how one item of `fn.map(items)` becomes arguments, checked before any cell starts.

A tuple is positional arguments, a dict keyword arguments, anything else (a list included) one
argument. Every cell is bound to the function's signature and pickled once to prove it can reach
another process; the first bad cell is reported by index and nothing is started.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import reprlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import cloudpickle

from levers9.errors import JobConfigError, NotShippableError

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60
_short.maxlist = 6
_short.maxtuple = 6
_short.maxdict = 6


@dataclasses.dataclass(frozen=True)
class Cell:
    """One call of the job function: its position in the input and its arguments."""

    index: int
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]

    def describe(self) -> str:
        """'(16, 0.0001)' or '(16, lr=0.0001)', shortened for messages."""
        parts = [_short.repr(a) for a in self.args] + [
            f"{k}={_short.repr(v)}" for k, v in self.kwargs.items()
        ]
        return "(" + ", ".join(parts) + ")"


def expand(item: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Arguments for one map item: tuple → positional, dict → keyword, anything else → one argument."""
    if isinstance(item, tuple):
        return item, {}
    if isinstance(item, dict):
        return (), dict(item)
    return (item,), {}


def make_cells(
    func: Callable[..., Any], items: Iterable[Any], *, kwargs: Mapping[str, Any] | None = None
) -> list[Cell]:
    """Expand and check every item; JobConfigError / NotShippableError for the first that does not fit."""
    cells = []
    for index, item in enumerate(items):
        args, kw = expand(item)
        if kwargs:
            kw = {**kwargs, **kw}
        cells.append(Cell(index, args, kw))
    for cell in cells:
        check_cell(func, cell)
    return cells


def check_cell(func: Callable[..., Any], cell: Cell, *, label: str | None = None) -> None:
    """Raise if `cell` does not fit `func`'s signature or cannot be pickled."""
    label = label or f"cell #{cell.index}"
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        try:
            signature.bind(*cell.args, **cell.kwargs)
        except TypeError as exc:
            bare = signature.replace(
                parameters=[
                    p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()
                ],
                return_annotation=inspect.Signature.empty,
            )
            raise JobConfigError(
                f"{label} {cell.describe()} does not fit {func.__name__}{bare}: {exc}. "
                f"Pass a tuple for positional arguments or a dict for keyword arguments."
            ) from None
    for where, value in [*((f"argument {i}", a) for i, a in enumerate(cell.args)), *cell.kwargs.items()]:
        try:
            cloudpickle.dump(value, _Discard())
        except Exception as exc:
            raise NotShippableError(
                f"{label}: {where} = {_short.repr(value)} ({type(value).__name__}) cannot be pickled "
                f"({type(exc).__name__}: {exc}); a job runs in another process, so its arguments must be "
                f"picklable. Pass what the object is built from (a path, a config) instead."
            ) from exc


class _Discard(io.RawIOBase):
    """A writable sink that keeps nothing: pickling into it proves picklability without the memory."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return len(data)
