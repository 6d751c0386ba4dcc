"""The package as users install it: sdist -> wheel -> ``simigrad-train`` run from an empty folder; the library alone.

The wheel is built from the sdist (as ``python -m build`` does), so a file the sdist forgets fails the build here.
Both builds use this environment's setuptools and install nothing from an index (``--no-deps``, no build
isolation); the installed wheel runs on this environment's dependencies through ``PYTHONPATH``.
"""

from __future__ import annotations

import csv
import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VERSION = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)[1]  # type: ignore[index]
RECIPE_EXTRA_ONLY = ("hydra-core", "torchvision", "transformers", "wandb")  # distributions the library must not need


def run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None, timeout: int = 300) -> str:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@dataclass
class Installed:
    sdist: Path
    wheel: Path
    site: Path  # the `pip install --target` folder


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    dist = tmp_path_factory.mktemp("dist")
    # the build backend's own sdist hook, the one `python -m build --sdist` calls
    run(sys.executable, "-c", "import sys, setuptools.build_meta as b; b.build_sdist(sys.argv[1])", dist, cwd=REPO)
    (sdist,) = dist.glob("lightning_simigrad-*.tar.gz")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    run(*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist / "wheel", sdist, cwd=dist)
    (wheel,) = (dist / "wheel").glob("lightning_simigrad-*.whl")
    run(*pip, "install", "--no-deps", "--no-index", "--target", dist / "site", wheel, cwd=dist)
    return Installed(sdist, wheel, dist / "site")


def test_wheel_ships_our_two_packages_with_every_module_and_config(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    assert installed.wheel.name == f"lightning_simigrad-{VERSION}-py3-none-any.whl"
    assert {name.split("/")[0] for name in names} == {
        "lightning_simigrad",
        "lightning_simigrad_recipes",
        f"lightning_simigrad-{VERSION}.dist-info",
    }
    # everything in the checkout's folders, found by the build without a list of files
    expected = {"lightning_simigrad/py.typed"}
    for folder, installed_as, pattern in [
        ("lightning_simigrad", "lightning_simigrad", "*.py"),
        ("recipes", "lightning_simigrad_recipes", "*.py"),
        ("conf", "lightning_simigrad_recipes/conf", "*.py"),
        ("conf", "lightning_simigrad_recipes/conf", "*.yaml"),
    ]:
        expected |= {f"{installed_as}/{p.relative_to(REPO / folder)}" for p in (REPO / folder).rglob(pattern)}
    assert {"lightning_simigrad_recipes/conf/train.yaml", "lightning_simigrad_recipes/data/digits.py"} <= expected
    assert expected <= names, sorted(expected - names)
    entry_points = zipfile.ZipFile(installed.wheel).read(f"lightning_simigrad-{VERSION}.dist-info/entry_points.txt")
    assert "simigrad-train = lightning_simigrad_recipes.train:main" in entry_points.decode()


def test_installed_wheel_trains_from_an_empty_folder(installed: Installed, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_", "SIMIGRAD_", "PYTHON"))}
    env.update(PYTHONPATH=str(installed.site), WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="2")
    where = tmp_path / "elsewhere"
    where.mkdir()
    # the code and the configs come from the installed wheel, not from the checkout's editable install
    found = run(sys.executable, "-c", (
        "import importlib.util, importlib.metadata as m, lightning_simigrad_recipes.conf as c; "
        "print(importlib.util.find_spec('lightning_simigrad').origin, c.__file__, m.version('lightning-simigrad'))"
    ), cwd=where, env=env).split()  # fmt: skip
    assert all(Path(path).is_relative_to(installed.site) for path in found[:2]), found
    assert found[2] == VERSION
    train = installed.site / "bin" / "simigrad-train"

    shown = run(train, "--help", cwd=where, env=env)
    experiments = next(line for line in shown.splitlines() if line.startswith("experiment: "))
    shipped = {p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")}
    assert set(experiments.removeprefix("experiment: ").split(", ")) == shipped

    run(train, "debug=smoke", "num_threads=2", cwd=where, env=env)
    run(train, "experiment=bert_tiny_pydoc", "debug=smoke", "logger=none", cwd=where, env=env)
    for name in ("digits", "bert_tiny_pydoc"):
        (run_dir,) = (where / "outputs" / name).iterdir()  # Hydra's run folder, relative to where it ran
        with (run_dir / "simigrad_trace.csv").open() as f:
            rows = list(csv.DictReader(f))
        # debug=smoke: max_steps=4 steps of B0 = 8 samples, the last step cut to what is left of the 32
        assert [float(row["step"]) for row in rows] == list(range(len(rows))) and 2 <= len(rows) <= 4
        sizes = [float(row["batch_size"]) for row in rows]
        assert sizes[0] == 8 and all(8 <= size <= 32 for size in sizes[:-1])  # debug=smoke's B0 and bounds
        assert float(rows[-1]["samples_seen"]) == sum(sizes) == 32
        assert (run_dir / "simigrad_trace.png").stat().st_size > 1000
    assert list((where / "outputs" / "digits").glob("*/wandb/offline-run-*"))  # the default logger, offline
    assert list((where / "outputs" / "bert_tiny_pydoc").glob("*/tokenizer/vocab.txt"))


def test_library_imports_and_runs_without_the_recipes_extra(tmp_path: Path) -> None:
    """``import lightning_simigrad`` where Hydra, torchvision, transformers and wandb are not installed.

    Only hiding them shows it: where they are installed, Lightning's torchmetrics imports torchvision and
    transformers by itself. So this runs Python without its site-packages, on a folder of links to every
    installed entry except those distributions' files.
    """
    hidden = {
        (entry.parts or ("",))[0]
        for dist in RECIPE_EXTRA_ONLY
        for entry in (importlib.metadata.distribution(dist).files or [])
    }
    site = Path(importlib.metadata.distribution("torch").locate_file(""))
    view = tmp_path / "site"
    view.mkdir()
    for entry in site.iterdir():
        if entry.name not in hidden:
            (view / entry.name).symlink_to(entry)
    package = Path(__import__("lightning_simigrad").__file__).parent  # the checkout's under an editable install
    if not (view / "lightning_simigrad").exists():
        (view / "lightning_simigrad").symlink_to(package)
    code = (
        "import sys, lightning_simigrad as ls; ls.SimiGrad(target_similarity=0.8); "
        "print(ls.__version__, sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'torchvision', "
        "'transformers', 'wandb', 'lightning_simigrad_recipes'}))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(view)
    version, imported = run(sys.executable, "-S", "-c", code, cwd=tmp_path, env=env).strip().split(" ", 1)
    assert (version, imported) == (VERSION, "[]")
    # the hiding works: the same interpreter on the view cannot import them
    probe = subprocess.run([sys.executable, "-S", "-c", "import hydra"], cwd=tmp_path, env=env, capture_output=True)
    assert probe.returncode != 0


def test_version_is_the_installed_distributions() -> None:
    import lightning_simigrad

    assert lightning_simigrad.__version__ == importlib.metadata.version("lightning-simigrad") == VERSION
