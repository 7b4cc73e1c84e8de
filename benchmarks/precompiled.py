"""Compile a levers9 tree's modules to bytecode before timing it, as `pip install` does for an installed package.

    from precompiled import precompile
    precompile(HERE.parent)          # this checkout's levers9/
    precompile(Path("/tmp/before"))  # and the tree it is compared against

torch and every other installed package are timed with their bytecode compiled at install time. A checkout
imported from source under PYTHONDONTWRITEBYTECODE=1 (set on this project's machines) is compiled anew on
every import: about 40 ms of `import levers9.distributed` on a 2-core machine, which no installed levers9
pays. Compiling once, untimed, puts the checkout on the same footing. The `__pycache__` folders it writes
are ignored by git.
"""

from __future__ import annotations

import compileall
from pathlib import Path


def precompile(tree: Path) -> None:
    """Write `tree/levers9`'s bytecode (even where PYTHONDONTWRITEBYTECODE is set); SystemExit when it fails."""
    package = tree / "levers9"
    if not compileall.compile_dir(str(package), quiet=1):
        raise SystemExit(f"could not compile {package} to bytecode; expected a levers9 tree that imports cleanly")
