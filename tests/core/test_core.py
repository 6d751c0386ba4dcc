"""The pure core stands alone: it imports and passes its doctests with Lightning and torch.distributed unimportable."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import lightning_simigrad

CORE = pathlib.Path(lightning_simigrad.__file__).parent / "core"

SCRIPT = textwrap.dedent(
    """
    import doctest, importlib, pathlib, sys, types
    for blocked in ("lightning", "lightning.pytorch", "pytorch_lightning", "torch.distributed"):
        sys.modules[blocked] = None  # `import` of any of them now raises ImportError
    library = pathlib.Path(sys.argv[1])
    package = types.ModuleType("lightning_simigrad")  # the package without its __init__ (which wires Lightning)
    package.__path__ = [str(library)]
    sys.modules["lightning_simigrad"] = package
    attempted = {}
    for path in sorted((library / "core").glob("*.py")):
        module = importlib.import_module(f"lightning_simigrad.core.{path.stem}")
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, (path.stem, result)
        attempted[path.stem] = result.attempted
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "torch") and sys.modules[m] is not None)
    print(attempted, loaded)
    """
)


def test_the_core_runs_its_doctests_without_lightning_or_torch_distributed():
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(CORE.parent)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    attempted, loaded = out.stdout.strip().split("} ", 1)
    counts = eval(attempted + "}")  # noqa: S307 (our own subprocess's printout)
    modules = {path.stem for path in CORE.glob("*.py")} - {"__init__"}
    assert set(counts) >= modules
    assert all(counts[name] > 0 for name in modules), counts  # every module of the core has doctests that ran
    assert loaded == "[]"  # nor did the core import torch at all
