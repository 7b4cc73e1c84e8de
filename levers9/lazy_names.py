"""A package's public names, each loaded with its own module on first use (PEP 562), not with the package.

Importing any module under a package runs the package's `__init__`; a package that imported its public
names there would load them all for every such import (a SLURM or Ray task reading one table, a job process).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: each name of `homes` is taken from the module named there
    (relative to `package` when it starts with a dot) on first use, then kept on the package."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
