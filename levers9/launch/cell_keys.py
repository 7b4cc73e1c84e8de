"""A cell's key: the same for the same function and the same arguments, in every process.

A cell's key is a hash of the function's key (module, name, source) and the cell's pickled
arguments (sets in a fixed order, so the key is the same under any hash seed), so a changed function
body or changed inputs make new cells. Resume finds a cell's stored result by it (run_folder.py), and
a live run claims its cells by it (claims.py).
"""

from __future__ import annotations

import copyreg
import hashlib
import inspect
import io
import marshal
from collections.abc import Callable
from typing import Any

import cloudpickle

from levers9.launch.cells import Cell


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
