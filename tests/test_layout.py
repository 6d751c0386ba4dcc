"""The library keeps the shape docs/architecture.md draws: layers that import only the layers above, small classes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_simigrad"

# what each layer may import from the package (docs/architecture.md, "The layers"); the integration layer, the
# callback and the package's __init__ may import anything. `_compat` is the table of private members: a leaf.
MAY_IMPORT = {
    "core": {"core"},
    "exchange": {"_compat"},
    "measurement": {"core", "exchange", "measurement", "_compat"},
    "data": {"core", "data", "_compat"},
    "state": {"core", "data", "state"},
    "weighing": {"core", "exchange", "measurement", "_compat"},
    "run": {"core", "exchange", "measurement", "data", "state", "weighing", "run", "_compat"},
}


def layer_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imported_layers(source: str) -> set[str]:
    """The package's layers a module imports at run time (imports under ``if TYPE_CHECKING:`` are left out)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == "lightning_simigrad":
                if len(parts) > 1:
                    found.add(parts[1])
                else:
                    found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "lightning_simigrad" and len(parts) > 1:
                    found.add(parts[1])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def test_every_layer_imports_only_the_layers_above_it():
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        allowed = MAY_IMPORT.get(layer_of(path))
        if allowed is None:
            continue
        wrong = imported_layers(path.read_text()) - allowed
        if wrong:
            offences.append(f"{path.relative_to(PACKAGE)} imports {sorted(wrong)}")
    assert not offences, offences


def test_the_import_scan_finds_what_it_looks_for():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from lightning_simigrad.core.plan import Window\n"
        "from lightning_simigrad import _compat, run\n"
        "import lightning_simigrad.integration.reporting\n"
        "def f():\n    from lightning_simigrad.state import rng\n"
        "if TYPE_CHECKING:\n    from lightning_simigrad.callback import SimiGrad\n"
    )
    assert imported_layers(source) == {"core", "_compat", "run", "integration", "state"}


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_class_is_over_250_lines(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            assert length <= 250, f"{path.name}: class {node.name} has {length} lines"


def test_the_callback_module_is_at_most_300_lines():
    assert len((PACKAGE / "callback.py").read_text().splitlines()) <= 300


def module_imports(path: Path) -> set[str]:
    """The package's modules ``path`` imports, at run time or for type checking (``a.b`` for ``a/b.py``); the
    package ``__init__`` Python runs on the way to a submodule is not counted (only names taken from it are)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from a.b import c`: the module a.b.c if there is one, else a.b's names (a.b's __init__ if a package)
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] != "lightning_simigrad":
                continue
            while parts:  # the longest prefix that is a module of the package
                candidate = PACKAGE.parent.joinpath(*parts)
                if candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file():
                    found.add(".".join(parts[1:]) or "__init__")
                    break
                parts = parts[:-1]
    return found


def test_no_module_imports_itself_through_others():
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).with_suffix("")
        name = ".".join(relative.parts[:-1]) if relative.name == "__init__" else ".".join(relative.parts)
        graph[name or "__init__"] = module_imports(path) - {name or "__init__"}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        if node in trail:
            cycles.append(" -> ".join(trail[trail.index(node) :] + [node]))
            return
        if node in done:
            return
        for successor in sorted(graph.get(node, ())):
            visit(successor, [*trail, node])
        done.add(node)

    done: set[str] = set()
    for node in sorted(graph):
        visit(node, [])
    # the package's __init__ re-exports the public names: only it may import the callback and what lies below
    cycles = [c for c in cycles if not c.startswith("__init__")]
    assert not cycles, cycles
