"""``simigrad-trace`` and ``simigrad=replay`` on the trace a smoke run wrote: the summary states the run, the schedule
it writes is the trace's batch sizes (YAML and a Python literal), a bad path or file is one line and exit code 2, and
``simigrad=replay`` trains the recorded batch sizes again, from the trace and from the schedule."""

from __future__ import annotations

import ast
import csv
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_simigrad_recipes.errors import RecipeError
from lightning_simigrad_recipes.trace_command import main
from lightning_simigrad_recipes.train import train
from tests.recipes.test_recipes import TINY, compose_cfg

SMOKE = ["debug=smoke", "trainer.max_steps=16", *TINY]  # 16 steps of B0 = 8 samples: 128 samples, the batch moving


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return train(compose_cfg([*SMOKE, f"output_dir={tmp_path_factory.mktemp('recorded')}"]))


def rows_of(path: str | Path) -> list[dict[str, float]]:
    with open(path) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def sizes_of(path: str | Path) -> list[int]:
    return [int(row["batch_size"]) for row in rows_of(path)]


def expected_steps(path: str | Path) -> dict[int, int]:
    """{samples trained before a step: its batch size}, where the size changes."""
    steps: dict[int, int] = {}
    for row in rows_of(path):
        if not steps or list(steps.values())[-1] != row["batch_size"]:
            steps[int(row["samples_seen"] - row["batch_size"])] = int(row["batch_size"])
    return steps


def test_the_summary_states_the_run(recorded, capsys: pytest.CaptureFixture[str]) -> None:
    path = recorded["trace_csv"]
    main([path])
    out = capsys.readouterr().out.splitlines()
    rows, sizes = rows_of(path), sizes_of(path)
    assert len(set(sizes)) >= 3  # the batch moved
    assert out[0] == f"{path}: {len(sizes)} steps, batch sizes in samples, {sum(sizes)} samples trained"
    assert out[1] == f"batch size {min(sizes)}..{max(sizes)} samples, B0 = 8 (the first step's), last step {sizes[-1]}"
    similarities = [row["similarity"] for row in rows if math.isfinite(row["similarity"])]
    assert out[2] == f"similarity: median {statistics.median(similarities):.3f} over {len(similarities)} measured steps"
    assert out[3] == f"noise scale B_noise at the last measured step: {rows[-1]['noise_scale']:,.4g} samples"


def test_the_schedule_and_the_plot_are_written(recorded, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, expected = recorded["trace_csv"], expected_steps(recorded["trace_csv"])
    assert len(expected) >= 3
    main([path, "--plot", str(tmp_path / "trace.png"), "--schedule", str(tmp_path / "schedule.yaml")])
    assert (tmp_path / "trace.png").stat().st_size > 10_000
    written = yaml.safe_load((tmp_path / "schedule.yaml").read_text())
    assert written == {"unit": "samples", "schedule": expected}
    main([path, "--schedule", str(tmp_path / "schedule.py")])
    assert ast.literal_eval((tmp_path / "schedule.py").read_text()) == expected
    main([path, "--schedule", str(tmp_path / "snapped.yaml"), "--smooth", "3", "--snap", "doubling"])
    snapped = yaml.safe_load((tmp_path / "snapped.yaml").read_text())["schedule"]
    assert snapped[0] == 8 and set(snapped.values()) <= {8, 16, 32}  # B0 x 2^k, within the smoke's 8..32
    assert "schedule (smooth 3, snap doubling): " in capsys.readouterr().out
    main([path, "--schedule", str(tmp_path / "b0.yaml"), "--snap", "doubling", "--initial-batch-size", "16"])
    from_b0 = yaml.safe_load((tmp_path / "b0.yaml").read_text())["schedule"]
    assert from_b0[0] == 16 and set(from_b0.values()) <= {16, 32}  # levels from the B0 given, never below it


def run_command(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightning_simigrad_recipes.trace_command", *args],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_bad_path_or_file_is_one_line_and_exit_code_2(recorded, tmp_path: Path) -> None:
    (tmp_path / "notes.csv").write_text("loss,acc\n0.5,0.9\n")
    (tmp_path / "cut.csv").write_text("step,samples_seen,batch_size\n0,8,8\n1,24,8\n2,16,8\n")
    cases = {
        ("missing.csv",): "'missing.csv' is not a file: pass the simigrad_trace.csv a recipe wrote",
        ("notes.csv",): "has no `batch_size`, `samples_seen` or `tokens_seen` column",
        ("cut.csv",): "line 4 ends at 16 samples trained with a batch of 8, so it starts before line 3 ends",
        (recorded["trace_csv"], "--schedule", "out.txt"): "--schedule out.txt: end the name in .yaml",
        (recorded["trace_csv"], "--smooth", "4"): "`smooth` = 4: the steps of the median's window, an odd",
    }
    for args, message in cases.items():
        proc = run_command(*args, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stdout == "", (args, proc.stdout, proc.stderr)
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and message in proc.stderr, args


def test_simigrad_replay_trains_the_recorded_batches_again(recorded, tmp_path: Path) -> None:
    path = recorded["trace_csv"]
    main([path, "--schedule", str(tmp_path / "schedule.yaml")])
    for trace in (path, tmp_path / "schedule.yaml"):
        out = tmp_path / Path(trace).stem
        result = train(compose_cfg(["simigrad=replay", f"simigrad.trace={trace}", *SMOKE, f"output_dir={out}"]))
        assert sizes_of(result["trace_csv"]) == sizes_of(path), trace
        # the same windows, B0 and learning rates: the same weights, so the same validation loss
        assert result["metrics"]["val/loss"] == recorded["metrics"]["val/loss"], trace
    for overrides, message in (
        ([], "simigrad=replay needs simigrad.trace=PATH"),
        (
            [f"simigrad.trace={tmp_path / 'schedule.yaml'}", "simigrad.smooth=3"],
            "a schedule file is replayed as written",
        ),
    ):
        with pytest.raises(Exception) as refused:  # hydra wraps the RecipeError; the command line prints it alone
            train(compose_cfg(["simigrad=replay", *overrides, *SMOKE, f"output_dir={tmp_path / 'refused'}"]))
        cause = refused.value if isinstance(refused.value, RecipeError) else refused.value.__cause__
        assert isinstance(cause, RecipeError) and message in str(cause)
