"""Private members of Lightning and torch: all in `_compat`'s table, only in the integration layer, checked at fit.

And what importing the package and running a fit leave behind: nothing of Lightning's or torch's changed.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

import lightning_simigrad
from lightning_simigrad import SimiGrad, _compat
from tests.support.helpers import IndexedRegression, Regressor, trainer

LIBRARY = pathlib.Path(lightning_simigrad.__file__).parent
# where private members may be touched: the adapters to Lightning, and the table itself
ALLOWED = {LIBRARY / "integration", LIBRARY / "_compat.py"}


def private_accesses(path: pathlib.Path) -> list[tuple[int, str, str]]:
    """``(line, object, member)`` for every ``x._member`` where ``x`` is not ``self``, ``cls`` or this package."""
    tree = ast.parse(path.read_text())
    own_modules = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_simigrad")
        for alias in node.names
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = ast.unparse(node.value)
            if owner not in ("self", "cls") and owner.split(".")[0] not in own_modules:
                found.append((node.lineno, owner, node.attr))
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("lightning", "torch"):
            found += [(node.lineno, node.module or "", a.name) for a in node.names if a.name.startswith("_")]
    return found


def library_files() -> list[pathlib.Path]:
    return sorted(LIBRARY.rglob("*.py"))


def allowed(path: pathlib.Path) -> bool:
    return any(path == place or place in path.parents for place in ALLOWED)


def test_no_private_member_of_lightning_or_torch_outside_the_integration_layer_and_compat():
    outside = {
        f"{path.relative_to(LIBRARY)}:{line}: {owner}.{name}"
        for path in library_files()
        if not allowed(path)
        for line, owner, name in private_accesses(path)
    }
    assert outside == set()


def test_every_private_member_the_integration_layer_touches_is_in_the_table():
    listed = {member.name for member in _compat.PRIVATE_MEMBERS}
    touched = {
        (str(path.relative_to(LIBRARY)), name)
        for path in library_files()
        if allowed(path) and path.name != "_compat.py"
        for _, _, name in private_accesses(path)
    }
    assert touched and {(where, name) for where, name in touched if name not in listed} == set()


def test_the_scan_finds_what_it_looks_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource\n"
        "def f(trainer, self):\n    self._mine = trainer.fit_loop._data_source\n"
    )
    assert {(owner, name) for _, owner, name in private_accesses(sample)} == {
        ("lightning.pytorch.trainer.connectors.data_connector", "_DataLoaderSource"),
        ("trainer.fit_loop", "_data_source"),
    }


def test_this_lightning_and_torch_have_every_member_the_table_lists():
    t = trainer(max_epochs=1)
    loop = t.fit_loop
    assert _compat.missing([t, loop, loop.epoch_loop, loop.epoch_loop.automatic_optimization]) == []
    _compat.check(t)


def test_a_missing_member_is_refused_before_the_fit_with_the_lightning_to_install(monkeypatch):
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    monkeypatch.delattr(_TrainingEpochLoop, "_accumulated_batches_reached")
    model = Regressor()
    with pytest.raises(RuntimeError, match=r"_TrainingEpochLoop._accumulated_batches_reached.*lightning>=2.6,<2.7"):
        trainer(callbacks=[SimiGrad(target_similarity=0.9)], max_epochs=1).fit(
            model, DataLoader(IndexedRegression(32), batch_size=8)
        )
    assert model.micro_batches == []  # refused before the first step


SNAPSHOT = textwrap.dedent(
    """
    import inspect, torch, lightning.pytorch as pl
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
    from lightning.pytorch.callbacks import LearningRateMonitor, TQDMProgressBar, RichProgressBar
    from torch.nn.parallel import DistributedDataParallel
    CLASSES = [pl.Trainer, _MultiProcessingLauncher, _TrainingEpochLoop, _FitLoop, _AutomaticOptimization,
               LearningRateMonitor, TQDMProgressBar, RichProgressBar, DistributedDataParallel, torch.optim.Optimizer]
    def snapshot():
        return {c.__qualname__: {k: id(v) for k, v in vars(c).items()} for c in CLASSES}
    """
)


def test_importing_the_package_patches_nothing():
    script = SNAPSHOT + "before = snapshot()\nimport lightning_simigrad\nassert snapshot() == before\nprint('same')"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "same", out.stderr[-2000:]


def test_after_a_fit_lightnings_classes_and_the_trainer_are_as_they_were():
    namespace: dict = {}
    exec(SNAPSHOT, namespace)
    before = namespace["snapshot"]()
    t = trainer(callbacks=[SimiGrad(target_similarity=0.9)], max_epochs=1)
    loops = [t.fit_loop, t.fit_loop.epoch_loop, t.fit_loop.epoch_loop.automatic_optimization]
    instance_attributes = [set(vars(o)) for o in loops]
    t.fit(Regressor(), DataLoader(IndexedRegression(64), batch_size=8, shuffle=True))
    assert namespace["snapshot"]() == before
    assert type(t) is pl.Trainer  # the per-fit subclass that counts the fit in samples is given back
    assert [set(vars(o)) for o in loops] == instance_attributes  # the loops' replaced methods are gone
