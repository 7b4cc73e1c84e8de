"""Map cells: how one item of `fn.map(items)` becomes arguments, checked before any cell starts.

A tuple is positional arguments, a dict keyword arguments, anything else (a list included) one
argument. Every cell is bound to the function's signature and pickled once to prove it can reach
another process; the first bad cell is reported by index and nothing is started.
"""

from __future__ import annotations

import copyreg
import dataclasses
import hashlib
import inspect
import io
import marshal
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
        cells.append(Cell(index, args, {**(kwargs or {}), **kw}))
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


# A cell's key: the same for the same function and arguments in every process, and new when the function's
# body or the inputs change. Resume finds a cell's stored result by it, and a live run claims its cells by it.


def function_key(func: Callable[..., Any]) -> str:
    """A hash of what the function is: module, qualified name and source (the code object without source)."""
    try:
        body = inspect.getsource(func).encode()
    except (OSError, TypeError):
        code = getattr(func, "__code__", None)
        body = marshal.dumps(code) if code is not None else cloudpickle.dumps(func)
    name = f"{getattr(func, '__module__', '')}:{getattr(func, '__qualname__', '')}"
    return hashlib.sha256(name.encode() + b"\0" + body).hexdigest()[:32]


def cell_key(fn_key: str, cell: Cell) -> str:
    """A hash of the function's key and the cell's arguments (not its index), the same in every process:
    sets are pickled in a fixed order, not in their hash order (which follows PYTHONHASHSEED)."""
    blob = _canonical_bytes((cell.args, sorted(cell.kwargs.items())))
    return hashlib.sha256(fn_key.encode() + b"\0" + blob).hexdigest()[:40]


class _KeyMark:
    """Stands for 'a set of' or 'the class named' in key bytes (pickled by reference, so no argument can
    look like it)."""


class _KeyPickler(cloudpickle.Pickler):
    """cloudpickle, with every set and frozenset written in the order of its members' own key bytes,
    also inside the state of other objects (pickle calls reducer_override for those, never for a set),
    and a class cloudpickle would copy by value (one made in __main__) by its name instead of its
    random tracker id."""

    def reducer_override(self, obj: Any) -> Any:
        if obj is _KeyMark:
            return NotImplemented
        reduced = super().reducer_override(obj)  # classes and functions by value, as cloudpickle does
        if isinstance(obj, type):
            return reduced if reduced is NotImplemented else (_KeyMark, ("class", obj.__module__, obj.__qualname__))
        if reduced is not NotImplemented:
            return _sets_sorted(reduced, {})
        try:
            reducer = copyreg.dispatch_table.get(type(obj))
            reduced = reducer(obj) if reducer is not None else obj.__reduce_ex__(5)
        except Exception:
            return NotImplemented
        if not isinstance(reduced, tuple):
            return NotImplemented
        canonical = _sets_sorted(reduced, {})
        return canonical if canonical is not reduced else NotImplemented


def _sets_sorted(value: Any, seen: dict[int, Any]) -> Any:
    """`value` with every set inside its lists, tuples and dicts replaced by (_KeyMark, type, sorted
    members); `value` itself (the same object) when it holds no set."""
    kind = type(value)
    if id(value) in seen:
        return seen[id(value)]
    if kind in (set, frozenset):
        members = sorted((_sets_sorted(m, seen) for m in value), key=_canonical_bytes)
        made: Any = (_KeyMark, kind.__name__, tuple(members))
    elif kind in (list, tuple):
        items = [_sets_sorted(v, seen) for v in value]
        made = value if all(a is b for a, b in zip(items, value, strict=True)) else kind(items)
    elif kind is dict:
        pairs = [(_sets_sorted(k, seen), _sets_sorted(v, seen)) for k, v in value.items()]
        same = all(a is k and b is v for (a, b), (k, v) in zip(pairs, value.items(), strict=True))
        made = value if same else dict(pairs)
    else:
        return value
    seen[id(value)] = made
    return made


def _canonical_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    _KeyPickler(buffer, protocol=5).dump(_sets_sorted(value, {}))
    return buffer.getvalue()
