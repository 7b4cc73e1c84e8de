"""The package's layout as a reader relies on it: no import circle among levers9's modules (of any kind: at the
top, inside a function, or for type checkers only), and every file docs/architecture.md names exists. Pure: reads
files, imports nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "levers9"


def module_names() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its __init__.py)."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The levers9 modules `path` imports, at its top, inside a function or in an `if TYPE_CHECKING:` block;
    `from a import b` counts as an import of a.b when that is a module, else of a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {target for target in found if target in modules and target != name}


def import_circles(modules: dict[str, Path]) -> list[list[str]]:
    """The strongly connected groups of more than one module in the import graph (Tarjan), each sorted."""
    graph = {name: sorted(imports_of(path, name, modules)) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for name in graph:
        if name not in index:
            connect(name)
    return sorted(circles)


def test_no_module_of_levers9_imports_itself_through_others() -> None:
    circles = import_circles(module_names())
    assert circles == [], (
        "levers9's modules import each other in a circle (top-level, function-level or `if TYPE_CHECKING:` "
        "imports): " + "; ".join(" <-> ".join(c) for c in circles)
        + ". Expected none: move what both need into a module both import."
    )


def test_the_circle_finder_finds_circles_through_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import levers9.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from levers9 import a\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from levers9 import a\n")
    (tmp_path / "d.py").write_text("import levers9.e\n")
    (tmp_path / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from levers9.d import X\n")
    modules = {f"levers9.{n}": tmp_path / f"{n}.py" for n in "abcde"}
    assert import_circles(modules) == [["levers9.a", "levers9.b"], ["levers9.d", "levers9.e"]]


def named_files(text: str) -> set[str]:
    """The file paths a page names in backticks (`levers9/procs/start.py`, `procs/outcome.py`, `detect.py`)."""
    return set(re.findall(r"`([\w/.-]+\.(?:py|md|toml))`", text))


def test_every_file_the_architecture_page_names_exists() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    names = named_files(text)
    assert len(names) > 40  # the page's tables, read
    homes = [REPO, PACKAGE, PACKAGE / "distributed", PACKAGE / "launch", PACKAGE / "distributed" / "stalls"]
    missing = sorted(name for name in names if not any((home / name).is_file() for home in homes))
    assert missing == [], (
        f"docs/architecture.md names {missing}, which no folder of the repository or of levers9 holds. Expected "
        f"every file it names to exist: fix the page, or the file's name."
    )
