"""The documents say what the code does: the README's and docs/usage.md's tables of logged metrics list exactly the
metrics SimiGrad logs, each with the unit it counts where batches count samples and where they count tokens
(``lightning_simigrad.integration.reporting.METRIC_UNITS``), and a fit in each mode logs exactly those."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from lightning_simigrad import METRICS, SimiGrad
from lightning_simigrad.integration.reporting import METRIC_UNITS
from tests.support.helpers import IndexedRegression, Regressor, trainer
from tests.support.token_modules import Sequences, TokenModel, pad_collate

ROOT = Path(__file__).resolve().parents[1]


def metric_table(path: Path) -> dict[str, tuple[str | None, str | None]]:
    """The table of logged metrics in ``path``: each metric named in its first cell, with the units of its second
    ("samples / tokens"; "not logged" reads as None)."""
    text = path.read_text()
    start = text.index("| metric | counts: batches in samples / in tokens (`lengths`) | meaning |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        units = tuple(None if unit == "not logged" else unit for unit in cells[1].split(" / "))
        assert len(units) == 2, line
        for name in re.findall(r"`(simigrad/\w+)`", cells[0]):
            rows[name] = units
    return rows


@pytest.mark.parametrize("document", ["README.md", "docs/usage.md"])
def test_the_metric_tables_are_the_metrics_logged_with_their_units(document: str) -> None:
    assert metric_table(ROOT / document) == METRIC_UNITS


def test_each_mode_logs_exactly_the_metrics_its_units_declare() -> None:
    pl.seed_everything(0)
    samples = SimiGrad(0.5, initial_batch_size=8)
    trainer(callbacks=[samples]).fit(Regressor(), DataLoader(IndexedRegression(32), batch_size=4))
    dataset = Sequences()
    tokens = SimiGrad(0.5, lengths=[len(t) for t in dataset.tokens], initial_batch_size=80)
    trainer(callbacks=[tokens]).fit(TokenModel(), DataLoader(dataset, batch_size=4, collate_fn=pad_collate))
    for cb, mode in ((samples, 0), (tokens, 1)):
        logged = {f"simigrad/{key}" for key in cb.history[0]} - {"simigrad/step"}
        assert logged == {name for name, units in METRIC_UNITS.items() if units[mode] is not None}
    assert set(METRICS) == {name for name, (in_samples, _) in METRIC_UNITS.items() if in_samples is not None}


REFERENCE = re.compile(r":(?:mod|class|func|meth|attr|data|exc):`~?(lightning_simigrad[\w.]*)`")


def resolves(name: str) -> bool:
    """``name`` (dotted) is a module of the package, or an attribute reached from one."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attribute in parts[split:]:
                found = getattr(found, attribute)
        except AttributeError:
            return False
        return True
    return False


def test_every_reference_in_the_librarys_docstrings_names_something_that_exists() -> None:
    names = {
        (str(path.relative_to(ROOT)), match)
        for path in (ROOT / "lightning_simigrad").rglob("*.py")
        for match in REFERENCE.findall(path.read_text())
    }
    assert len(names) > 50
    assert [(path, name) for path, name in sorted(names) if not resolves(name)] == []


def library_index() -> tuple[set[str], dict[str, set[str]], set[str]]:
    """Every name the library defines (modules, classes, functions, fields, assignments), imports or holds as a
    string; each class's members (methods, fields, ``self.x`` attributes); and the files and folders it has."""
    names: set[str] = set()
    members: dict[str, set[str]] = {}
    paths: set[str] = set()
    package = ROOT / "lightning_simigrad"
    for path in package.rglob("*.py"):
        relative = path.relative_to(package)
        paths.update({str(relative), *(f"{parent}/" for parent in map(str, relative.parents) if parent != ".")})
        names.add(path.stem)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                found = members.setdefault(node.name, set())
                for child in ast.walk(node):
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        found.add(child.name)
                    elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
                        found.add(child.target.id)
                    elif isinstance(child, ast.Attribute) and isinstance(child.ctx, ast.Store):
                        found.add(child.attr)
                    elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                        found.add(child.id)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.alias):
                names.update({node.name, node.asname or node.name.split(".")[0]})
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
    return names, members, paths


def test_every_file_and_name_the_architecture_page_gives_exists() -> None:
    """docs/architecture.md names files (`core/units.py`, `tests/...`), names (`Unit`, `unit_of`) and members
    (`Unit.cut`) in code type: each must be the library's (or the repository's, for a path)."""
    names, members, paths = library_index()
    tokens = re.findall(r"`([^`]+)`", (ROOT / "docs" / "architecture.md").read_text())
    missing = []
    for token in tokens:
        if token.endswith((".py", "/")):
            if token not in paths and not (ROOT / token).exists():
                missing.append(token)
        elif re.fullmatch(r"[A-Za-z_]\w*", token):
            if token not in names:
                missing.append(token)
        elif re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", token):
            owner, member = token.split(".")[:2]
            known = member in members[owner] if owner in members else owner in names  # a class's, or a module's
            if not known:
                missing.append(token)
    assert len(tokens) > 100
    assert missing == []
