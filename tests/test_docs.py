"""The documentation's runnable examples run: every ```python block after a `<!-- run -->` line in
docs/*.md (and README.md) is run as a script in a fresh interpreter, on 4 simulated cards, and must exit 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import strip_launcher_env

pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# A `<!-- run -->` line, optional blank lines, then a fenced python block (captured up to its closing fence).
RUNNABLE = re.compile(r"^<!-- run -->\n(?:[ \t]*\n)*```python\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def runnable_blocks() -> list[tuple[str, str]]:
    """(page:line, code) for every block marked runnable."""
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for match in RUNNABLE.finditer(text):
            line = text.count("\n", 0, match.start(1)) + 1
            blocks.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
    return blocks


BLOCKS = runnable_blocks()


def test_the_docs_have_runnable_examples_and_every_marker_is_followed_by_a_python_block() -> None:
    markers = sum(page.read_text().count("<!-- run -->") for page in PAGES)
    assert len(BLOCKS) >= 8, f"expected the docs to keep their runnable examples, found {len(BLOCKS)}"
    assert markers == len(BLOCKS), "a `<!-- run -->` marker is not followed by a ```python block"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[where for where, _ in BLOCKS])
def test_a_runnable_example_runs(where: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ)
    strip_launcher_env(env)
    config = tmp_path / "config"
    config.mkdir()
    (config / "workspace.toml").write_text("[workspace]\nmulti_gpu = true\n")  # examples may use gpu_count > 1
    env.update(
        LEVERS9_SIMULATE_GPUS="RTXPro6000:4",
        LEVERS9_CONFIG_DIR=str(config),
        LEVERS9_STATE_DIR=str(tmp_path / "state"),
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, f"{where} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), f"{where} printed nothing; every runnable example shows its result"


# --- The site's shape: code that fits, the error tree, the reference, the examples, the versions ---

SITE_PAGES = sorted((ROOT / "docs").rglob("*.md"))
# What fits the content column of mkdocs-material in a 1280-pixel-wide window with the navigation and
# the table of contents shown: 82 characters of code, measured in headless Chromium (2026-12-05).
CODE_COLUMN = 82
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+)[^\n]*\n(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$", re.M | re.S)
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$', re.M)


def code_blocks(page: Path) -> list[tuple[int, str]]:
    """(first line number, text) of every fenced block of `page`, included files read in."""
    text = page.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        body = SNIPPET.sub(lambda m: (ROOT / m.group("path")).read_text(), match.group("body"))
        blocks.append((text.count("\n", 0, match.start("body")) + 1, body))
    return blocks


def test_code_blocks_fit_the_column() -> None:
    too_wide = [
        f"{page.relative_to(ROOT)}:{first + i} ({len(line)} > {CODE_COLUMN}): {line}"
        for page in SITE_PAGES
        for first, body in code_blocks(page)
        for i, line in enumerate(body.splitlines())
        if len(line) > CODE_COLUMN
    ]
    assert not too_wide, "code wider than the site's column; rewrap it:\n" + "\n".join(too_wide)


TREE_LINE = re.compile(r"^(?P<lead>(?:[│ ] {3})*)(?:[├└]── )?(?P<name>\w+)(?: \((?P<bases>[\w, ]+)\))?")


def parse_tree(block: str) -> dict[str, tuple[str | None, set[str]]]:
    """{class: (parent in the tree, the names in brackets)} from a drawn tree such as errors.md's."""
    tree: dict[str, tuple[str | None, set[str]]] = {}
    parents: list[str] = []
    for line in block.strip().splitlines():
        match = TREE_LINE.match(line.strip("\n"))
        assert match, f"not a tree line: {line!r}"
        depth = len(match.group("lead")) // 4 + (1 if line.lstrip("│ ").startswith(("├", "└")) else 0)
        del parents[depth:]
        name = match.group("name")
        assert name not in tree, f"{name} is drawn twice"
        bases = {b.strip() for b in (match.group("bases") or "").split(",") if b.strip()}
        tree[name] = (parents[-1] if parents else None, bases)
        parents.append(name)
    return tree


def error_classes() -> dict[str, tuple[str | None, set[str]]]:
    """{class: (its levers9 parent, its other bases)} for every exception in levers9.errors."""
    import levers9.errors as errors

    classes = {}
    for name, obj in vars(errors).items():
        if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__:
            bases = [b.__name__ for b in obj.__bases__ if b is not Exception]
            ours = [b for b in obj.__bases__ if b.__module__ == errors.__name__]
            parent = ours[0].__name__ if ours else None
            classes[name] = (parent, set(bases) - {parent})
    return classes


def test_the_error_tree_on_the_errors_page_and_in_the_module_is_levers9_errors() -> None:
    import levers9.errors as errors

    page = (ROOT / "docs" / "errors.md").read_text()
    drawn = next(body for _, body in code_blocks(ROOT / "docs" / "errors.md") if body.startswith("Levers9Error"))
    docstring = (errors.__doc__ or "").split("\n\n")[2]
    docstring = "\n".join(line[4:] for line in docstring.splitlines())
    expected = error_classes()
    for where, block in (("docs/errors.md", drawn), ("levers9/errors.py's docstring", docstring)):
        assert parse_tree(block) == expected, f"{where}: the tree differs from the classes in levers9.errors"
    assert "Levers9Error" in page


def test_every_error_has_a_what_to_do_line() -> None:
    page = (ROOT / "docs" / "errors.md").read_text()
    section = page.split("## What to do", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (.+) \|$", section, re.M)
    names = [name for name, _ in rows]
    assert len(names) == len(set(names)) and set(names) == set(error_classes()), "one row per class in levers9.errors"
    assert all(len(advice) > 40 for _, advice in rows)


def public_objects() -> dict[int, str]:
    """id(object) -> the path users import it by, for every public name of levers9."""
    import levers9
    import levers9.distributed
    import levers9.errors as errors
    import levers9.launch
    from levers9.launch.map_results import Completed

    names = {id(getattr(levers9, n)): f"levers9.{n}" for n in levers9.__all__ if n not in ("distributed", "launch", "__version__")}
    names |= {id(getattr(levers9.distributed, n)): f"levers9.distributed.{n}" for n in levers9.distributed.__all__}
    names |= {id(getattr(levers9.launch, n)): f"levers9.launch.{n}" for n in levers9.launch.__all__ if id(getattr(levers9.launch, n)) not in names}
    names |= {id(obj): f"levers9.errors.{n}" for n, obj in vars(errors).items() if isinstance(obj, type) and obj.__module__ == errors.__name__}
    names[id(Completed)] = "levers9.launch.map_results.Completed"  # what .map(order="completed") yields
    return names


def test_the_reference_documents_each_public_name_once_and_nothing_internal() -> None:
    import importlib

    public = public_objects()
    seen: dict[int, list[str]] = {}
    for page in sorted((ROOT / "docs" / "reference").glob("*.md")):
        for ident in re.findall(r"^::: ([\w.]+)$", page.read_text(), re.M):
            module, _, attr = ident.rpartition(".")
            obj = getattr(importlib.import_module(module), attr)
            seen.setdefault(id(obj), []).append(f"{page.name}: {ident}")
    internal = [where for key, wheres in seen.items() if key not in public for where in wheres]
    assert not internal, f"not public, so not in the reference: {internal}"
    twice = [wheres for wheres in seen.values() if len(wheres) > 1]
    assert not twice, f"documented more than once: {twice}"
    missing = sorted(path for key, path in public.items() if key not in seen)
    assert not missing, f"public but not in docs/reference/: {missing}"


def test_every_example_is_on_the_site_and_run_by_the_example_tests() -> None:
    examples = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    included = sorted(Path(p).name for p in SNIPPET.findall((ROOT / "docs" / "examples.md").read_text()))
    assert included == examples, "docs/examples.md includes every examples/*.py once"
    tests = (ROOT / "tests" / "test_examples.py").read_text()
    imported_by_others = {"tiny.py"}
    not_run = [name for name in examples if f"examples/{name}" not in tests and name not in imported_by_others]
    assert not not_run, f"examples no test in tests/test_examples.py runs: {not_run}"


def test_the_home_page_states_the_versions_pyproject_declares() -> None:
    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        import tomli as tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_spec = next(d for d in project["dependencies"] if re.match(r"torch\b", d)).replace(" ", "")
    python_min = re.fullmatch(r">=(\d+\.\d+)", project["requires-python"]).group(1)
    for page in (ROOT / "docs" / "index.md", ROOT / "README.md"):
        text = page.read_text()
        assert f"Python {python_min} or newer" in text, f"{page.name} does not say Python {python_min} or newer"
        assert f"`{torch_spec}`" in text, f"{page.name} does not say {torch_spec}"
    stated = {m for page in [*SITE_PAGES, ROOT / "README.md"] for m in re.findall(r"torch>=[\d.]+,<\d+", page.read_text())}
    assert stated == {torch_spec}, f"pages state torch ranges {stated}; pyproject.toml says {torch_spec}"
