"""docs/architecture.md names every module under llmsupervisor/ (and no module that is gone), and
says why each module over 500 lines is that large: the layout map cannot go stale unnoticed.

The convention the checks read: each module is a list item that starts with its path under
llmsupervisor/ in backticks (``- `engine/runner.py`: ...``), and the item of a module over
LARGE_LINES lines contains ``**Why large:**``.

And no import circle in llmsupervisor/, counting every import the source writes: under
``if TYPE_CHECKING:`` and inside functions too. The layer contracts (``lint-imports``) hold the
order between and inside packages; this holds it for every module, listed in a contract or not.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "llmsupervisor"
ARCHITECTURE = REPO / "docs" / "architecture.md"
LARGE_LINES = 500

# A list item that names a module, and its text up to the next item, heading or blank line.
_ITEM = re.compile(r"^- `([\w/]+\.py)`(.*?)(?=^- |^#|^\s*$)", re.M | re.S)


def modules() -> dict[str, int]:
    """Every module file under llmsupervisor/, as a path relative to it, with its line count."""
    return {
        p.relative_to(PACKAGE).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def items() -> dict[str, str]:
    return {m.group(1): m.group(2) for m in _ITEM.finditer(ARCHITECTURE.read_text(encoding="utf-8"))}


def test_the_item_pattern_reads_the_convention() -> None:
    text = "- `a.py`: one.\n  **Why large:** two.\n- `b/c.py`: three.\n\n### next\n"
    found = {m.group(1): m.group(2) for m in _ITEM.finditer(text)}
    assert list(found) == ["a.py", "b/c.py"]
    assert "**Why large:**" in found["a.py"] and "**Why large:**" not in found["b/c.py"]


def test_every_module_is_named() -> None:
    missing = sorted(set(modules()) - set(items()))
    assert missing == [], f"add a line for each to docs/architecture.md: {missing}"


def test_every_named_module_exists() -> None:
    gone = sorted(set(items()) - set(modules()))
    assert gone == [], f"docs/architecture.md names modules that are not there: {gone}"


def test_every_large_module_says_why() -> None:
    described = items()
    unexplained = sorted(
        f"{path} ({lines} lines)"
        for path, lines in modules().items()
        if lines > LARGE_LINES and "**Why large:**" not in described.get(path, "")
    )
    assert unexplained == [], f"say under **Why large:** in docs/architecture.md why: {unexplained}"


def module_files(package: Path) -> dict[str, Path]:
    """Every module of ``package`` by its dotted name (a package by its own name, not ``__init__``)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(module: str, path: Path, known: Mapping[str, Path]) -> Iterator[str]:
    """The modules of ``known`` that ``module`` imports anywhere in its source: at the top, under
    ``if TYPE_CHECKING:``, inside a function. ``from a import b`` is module ``a.b`` where there is
    one, else ``a``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                while name and name not in known:
                    name = name.rpartition(".")[0]
                if name:
                    yield name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    yield f"{base}.{alias.name}"
                elif base in known:
                    yield base


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    known = module_files(package)
    return {module: set(_imported(module, path, known)) - {module} for module, path in known.items()}


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm): each holds
    at least one circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_import_graph_counts_type_checking_and_late_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from pkg.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "sub" / "c.py").write_text("from .. import b\nfrom . import d\nimport pkg.sub.d\n")
    (pkg / "sub" / "d.py").write_text("")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.sub.c"] == {"pkg.b", "pkg.sub.d"}
    assert circles(graph) == [["pkg.a", "pkg.b"]]


def test_no_import_circle_in_the_package() -> None:
    assert circles(import_graph(PACKAGE)) == [], "an import circle: move the shared part below both"


# Argument-parser builders are one add_argument after another: long, and flat (issue 35).
PARSER_BUILDERS = frozenset({"_parser"})
MAX_FUNCTION_LINES = 100


def test_no_function_is_longer_than_100_lines() -> None:
    """Issue 35, "Done when": every long function a short sequence of named steps. Judged by
    function, not file: a module that owns one concern may be long (its "Why large" note)."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name not in PARSER_BUILDERS:
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                    long.append(f"{where} {node.name}: {lines} lines")
    assert not long, "split into named steps:\n" + "\n".join(long)
