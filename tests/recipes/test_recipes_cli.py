"""``simigrad-train`` as users run it: a multirun sweep, ``--help``, a user's experiment beside ours
(``--config-dir``), and user errors as one line with exit code 2."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args: str, cwd: Path, timeout: int = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="2")
    return subprocess.run(
        [sys.executable, "-m", "lightning_simigrad_recipes.train", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_multirun_paper_and_off_gives_two_runs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "simigrad=paper,off", "debug=smoke", "logger=none", "num_threads=2",
                   f"hydra.sweep.dir={sweep}", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert runs == ["0_paper_seed0", "1_off_seed0"]
    sizes = {}
    for name in runs:
        with (sweep / name / "simigrad_trace.csv").open() as f:
            rows = list(csv.DictReader(f))
        assert (sweep / name / "simigrad_trace.png").is_file() and len(rows) == 4
        sizes[name] = {float(r["batch_size"]) for r in rows}
    assert sizes["1_off_seed0"] == {8.0}  # fixed batch B0
    assert "batch-size trace:" in proc.stdout


def test_help_lists_the_groups_and_the_shipped_experiments(tmp_path: Path) -> None:
    from importlib import resources

    from lightning_simigrad_recipes.train import CONFIG_MODULE

    proc = run_cli("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Hydra lists each group as "group: option, option, ..."
    groups = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if re.match(r"^\w+: ", line))
    assert {"experiment", "data", "model", "optimizer", "scheduler", "simigrad", "trainer", "logger", "debug"} <= set(
        groups
    )

    def shipped(group: str) -> set[str]:
        return {p.name.removesuffix(".yaml") for p in resources.files(CONFIG_MODULE).joinpath(group).iterdir()}

    assert set(groups["experiment"].split(", ")) == shipped("experiment")
    assert set(groups["simigrad"].split(", ")) == shipped("simigrad") >= {"paper", "off", "noise_scale", "ramp"}
    assert "--config-dir" in proc.stdout


# The README's example of user configs, verbatim (test_readme_shows_the_tested_user_configs keeps them in step).
USER_EXPERIMENT = """\
# @package _global_
defaults:
  - override /simigrad: noise_scale  # ours: jump to B* from the measured noise scale
  - override /optimizer: adamw       # ours
  - override /logger: csv            # ours
  - override /model: wide_cnn        # yours: my_conf/model/wide_cnn.yaml
name: my_exp
optimizer:
  lr: 0.002
"""
USER_MODEL = """\
defaults:
  - digits_cnn                       # ours, extended
net:
  width: 48
"""


def test_user_experiment_in_config_dir_overrides_our_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_simigrad_recipes.train import main

    (tmp_path / "my_conf" / "experiment").mkdir(parents=True)
    (tmp_path / "my_conf" / "model").mkdir()
    (tmp_path / "my_conf" / "experiment" / "my_exp.yaml").write_text(USER_EXPERIMENT)
    (tmp_path / "my_conf" / "model" / "wide_cnn.yaml").write_text(USER_MODEL)
    monkeypatch.chdir(tmp_path)  # a relative --config-dir, as a user types it
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # main() sets it; keep it from leaking into other tests
    run_dir = tmp_path / "run"
    argv = ["--config-dir", "./my_conf", "experiment=my_exp", "debug=smoke", "num_threads=2"]
    monkeypatch.setattr(sys, "argv", ["simigrad-train", *argv, f"hydra.run.dir={run_dir}"])
    main()
    assert "my_exp-noise_scale-seed0" in capsys.readouterr().out

    composed = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "name: my_exp" in composed and "_target_: torch.optim.AdamW" in composed and "lr: 0.002" in composed
    assert "controller: noise_scale" in composed
    assert "width: 48" in composed and "_target_: lightning_simigrad_recipes.models.nets.digits_cnn" in composed
    with (run_dir / "simigrad_trace.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 4  # debug=smoke, applied over the user's experiment
    assert list(run_dir.glob("logs/*/metrics.csv"))  # logger=csv


def test_the_docs_show_the_tested_user_configs() -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    assert f"```yaml\n{USER_EXPERIMENT}```" in readme and f"```yaml\n{USER_MODEL}```" in readme
    assert "simigrad-train --config-dir ./my_conf experiment=my_exp" in readme


def _error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bad")
    (root / "empty" / "train").mkdir(parents=True)
    (root / "empty" / "val").mkdir()
    (root / "flat" / "train").mkdir(parents=True)  # images directly in train/, no class folders
    (root / "flat" / "val").mkdir()
    (root / "flat" / "train" / "a.JPEG").write_bytes(b"\xff\xd8")
    broken = root / "broken" / "train" / "n01"  # a class folder holding a file that is no image
    broken.mkdir(parents=True)
    (broken / "x.JPEG").write_bytes(b"this is text")
    (root / "broken" / "val" / "n01").mkdir(parents=True)
    (root / "broken" / "val" / "n01" / "y.JPEG").write_bytes(b"this is text")
    (root / "text").mkdir()
    (root / "text" / "a.txt").write_text("some words " * 200)
    return root


# Run as users run them, in a subprocess: composition errors (fast, before torch is imported) and one data error.
CLI_CASES = {
    "unknown experiment": (["experiment=resnet1000"], "Could not find 'experiment/resnet1000'. Available options"),
    "unknown key": (["trainer.max_epoch=3"], "unknown config key 'trainer.max_epoch'"),
    "missing config dir": (["--config-dir", "{bad}/no_conf", "experiment=mine"], "no_conf is not a folder"),
    "missing data root": (["experiment=resnet18_cifar10", "data.root={bad}/nowhere"], "is not a directory"),
    "missing tokenizer": (
        ["experiment=bert_large_pretrain", "data.files={bad}/text/*.txt", "tokenizer.path={bad}/no-vocab"],
        "tokenizer.path=",
    ),
}
# The same entry point, main(), called in-process (Lightning is already imported: no start-up cost per case).
MAIN_CASES = {
    "cifar root not set": (["experiment=resnet18_cifar10"], "data.root is not set"),
    "empty imagefolder": (["experiment=resnet50_imagenet", "data.root={bad}/empty"], "is not an ImageFolder tree"),
    "flat imagefolder": (["experiment=resnet50_imagenet", "data.root={bad}/flat"], "is not an ImageFolder tree"),
    "unreadable image": (["experiment=resnet50_imagenet", "data.root={bad}/broken"], "is not a readable image"),
    "no text files": (["experiment=bert_large_pretrain", "data.files={bad}/nothing/*.txt"], "matched no files"),
    "no tokenizer": (["experiment=bert_large_pretrain", "data.files={bad}/text/*.txt"], "no tokenizer given"),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_user_errors_are_one_line_and_exit_2(case: str, bad_inputs: Path, tmp_path: Path) -> None:
    overrides, expected = CLI_CASES[case]
    proc = run_cli(*[o.format(bad=bad_inputs) for o in overrides], "logger=none", cwd=tmp_path)
    assert expected in _error_line(proc)


@pytest.mark.parametrize("case", list(MAIN_CASES))
def test_main_reports_bad_data_in_one_line(
    case: str, bad_inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_simigrad_recipes.train import main

    overrides, expected = MAIN_CASES[case]
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # main() sets it; keep it from leaking into other tests
    argv = [o.format(bad=bad_inputs) for o in overrides]
    argv += ["logger=none", f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"]
    monkeypatch.setattr(sys, "argv", ["simigrad-train", *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    stderr = capsys.readouterr().err
    proc = subprocess.CompletedProcess(args=[], returncode=exit_info.value.code, stdout="", stderr=stderr)
    assert expected in _error_line(proc)
