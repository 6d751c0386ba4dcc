"""``benchmarks/efficiency.py``: the plan of runs, the reading of the frontier, and (slow) the ``--quick`` study."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import benchmark_module

efficiency = benchmark_module("efficiency")
SCRIPT = Path(efficiency.__file__)
REPO = SCRIPT.parents[1]


def row(method: str, batch: int, lr_mult: float, seed: int, metric: float, steps: int, target=None, variant=""):
    return {
        "run_id": f"{method}{variant}-{batch}-{lr_mult}-{target}-{seed}", "task": "t", "method": method,
        "variant": variant, "batch": batch, "lr": 0.1 * lr_mult, "lr_mult": lr_mult, "target": target, "seed": seed,
        "budget": 1000, "metric": "val/loss", "metric_value": metric, "accuracy": "val/acc",
        "accuracy_value": 1 - metric, "steps": steps, "mean_batch": 1000 / steps, "samples": 1000,
        "final_batch": batch, "batch_over_bstar": 1.0, "at_cap": 0.0, "wall_s": 1.0, "cpu_s": 1.0, "run_dir": "nowhere",
    }  # fmt: skip


def static_rows() -> list[dict]:
    rows = []
    # loss grows with the batch; at B=64 the best LR is the larger one (x2, a grid edge)
    for batch, steps, losses in ((16, 63, {0.5: 0.52, 1: 0.50, 2: 0.55}), (32, 32, {0.5: 0.58, 1: 0.55, 2: 0.56}),
                                 (64, 16, {0.5: 0.75, 1: 0.70, 2: 0.65})):  # fmt: skip
        for mult, loss in losses.items():
            rows += [row("static", batch, mult, s, loss + 0.01 * s, steps) for s in (0, 1)]
    return rows


def test_the_plan_covers_sizes_rates_seeds_and_starts_simigrad_from_b0() -> None:
    task = efficiency.with_recipe_defaults(efficiency.TASKS["digits"], [])
    assert task.smallest_batch == 16 and task.lr0 > 0
    sizes = [task.smallest_batch * 2**i for i in range(efficiency.SIZES)]
    static = efficiency.static_runs(task, "digits", sizes, [0.5, 1, 2], [0, 1, 2], 5000)
    assert len(static) == 6 * 3 * 3 and len({r.run_id for r in static}) == len(static)
    big = next(r for r in static if r.batch == 16 * 32 and r.lr_mult == 2 and r.seed == 0)
    assert f"optimizer.lr={task.lr0 * math.sqrt(32) * 2:.6g}" in big.overrides and "simigrad=off" in big.overrides
    simi = efficiency.simigrad_runs(task, "digits", 0.5, [0, 1, 2], 5000, [("linear", "simigrad.lr_scaling=linear")])
    assert {(r.method, r.target, r.variant) for r in simi} == {
        ("paper", task.targets[0], ""), ("paper", task.targets[1], ""), ("noise_scale", task.targets[0], ""),
        ("paper", task.targets[0], "linear"),
    }  # fmt: skip
    assert all(r.batch == task.smallest_batch and f"optimizer.lr={task.lr0 * 0.5:.6g}" in r.overrides for r in simi)
    assert len({r.run_id for r in simi}) == len(simi) == 12


def test_each_static_batch_keeps_its_best_rate_and_the_verdict_reads_the_frontier() -> None:
    groups = efficiency.group_rows(static_rows()).values()
    frontier = efficiency.best_static(groups)
    assert {b: g.first["lr_mult"] for b, g in frontier.items()} == {16: 1, 32: 1, 64: 2}
    # as good as the best static run (0.505, B=16 in 63 steps) in 20 steps: above the frontier
    good = efficiency.group_rows([row("paper", 16, 1, s, 0.50 + 0.01 * s, 20, target=0.5) for s in (0, 1)])
    v = efficiency.verdict(frontier, next(iter(good.values())))
    assert v["reaches_best"] and v["best_static_batch"] == 16 and v["static_steps_for_its_metric"] == pytest.approx(63)
    assert v["above_frontier"]
    # better than every static run: no static batch reaches its metric
    better = efficiency.group_rows([row("paper", 16, 1, s, 0.45, 70, target=0.5) for s in (0, 1)])
    v = efficiency.verdict(frontier, next(iter(better.values())))
    assert v["static_steps_for_its_metric"] is None and v["above_frontier"]
    # B=32 reaches 0.60 in 32 steps, and between B=64 (0.655, 16 steps) and B=32 a batch would in 16 * 2**0.55
    slow = efficiency.group_rows([row("paper", 16, 1, s, 0.60, 30, target=0.8) for s in (0, 1)])
    v = efficiency.verdict(frontier, next(iter(slow.values())))
    assert not v["reaches_best"] and v["static_steps_measured"] == 32
    assert v["static_steps_for_its_metric"] == pytest.approx(16 * 2**0.55) and not v["above_frontier"]


def test_ramps_start_from_b0_at_its_best_rate_and_reach_their_ends() -> None:
    task = efficiency.with_recipe_defaults(efficiency.TASKS["digits"], [])
    b0 = task.smallest_batch
    ramps = efficiency.ramp_runs(task, "digits", 0.5, [0, 1], 6000, quick=False)
    assert len(ramps) == (3 * 2 + 3) * 2 and len({r.run_id for r in ramps}) == len(ramps)
    assert all(r.batch == b0 and f"optimizer.lr={task.lr0 * 0.5:.6g}" in r.overrides and r.target is None
               for r in ramps)  # fmt: skip
    linear = {r.variant for r in ramps if r.method == "ramp_linear"}
    assert linear == {f"to{f * b0}-over-{part}" for f in (4, 16, 64) for part in ("quarter", "half")}
    sixfold = next(r for r in ramps if r.variant == f"to{b0 * 64}")  # six doublings, evenly spaced over 6000
    assert "simigrad.at=[857,1714,2571,3428,4285,5142]" in sixfold.overrides
    assert {r.variant for r in efficiency.ramp_runs(task, "digits", 1, [0], 6000, quick=True)} == {
        f"to{4 * b0}-over-half", f"to{4 * b0}"
    }  # fmt: skip


def test_ramps_and_simigrad_configurations_are_selected_by_name_in_the_order_given() -> None:
    task = efficiency.with_recipe_defaults(efficiency.TASKS["digits"], [])
    b0 = task.smallest_batch
    ramps = efficiency.ramp_runs(task, "digits", 0.5, [0, 1], 6000, quick=False)
    chosen = efficiency.select(ramps, f"to{4 * b0},to{16 * b0}-over-half", "ramp")
    assert [(r.method, r.variant, r.seed) for r in chosen] == [
        ("ramp_doubling", f"to{4 * b0}", 0), ("ramp_doubling", f"to{4 * b0}", 1),
        ("ramp_linear", f"to{16 * b0}-over-half", 0), ("ramp_linear", f"to{16 * b0}-over-half", 1),
    ]  # fmt: skip
    assert efficiency.select(ramps, None, "ramp") == ramps
    simi = efficiency.simigrad_runs(task, "digits", 0.5, [3], 5000, [("linear", "simigrad.lr_scaling=linear")])
    t0, t1 = task.targets
    picked = efficiency.select(simi, f"linear,paper-tau{t1:g}", "SimiGrad configuration")
    assert [(r.method, r.target, r.variant) for r in picked] == [("paper", t0, "linear"), ("paper", t1, "")]
    assert [r.method for r in efficiency.select(simi, f"noise_scale-tau{t0:g}", "x")] == ["noise_scale"]
    with pytest.raises(SystemExit, match="unknown ramp to3"):
        efficiency.select(ramps, "to3", "ramp")


def test_the_table_marks_the_best_rate_and_a_grid_edge(tmp_path: Path) -> None:
    rows = static_rows() + [row("noise_scale", 16, 1, s, 0.51, 25, target=0.5) for s in (0, 1)]
    rows += [row("ramp_linear", 16, 1, s, 0.60, 40, variant="to64-over-half") for s in (0, 1)]
    table = efficiency.summary_table(rows, "t")
    assert table.count("**best LR**") == 3 and table.count("(grid edge)") == 1
    assert "noise_scale tau=0.5" in table and "above the frontier" in table
    assert "- ramp_linear/to64-over-half: 0.6000 in 40 steps" in table and "not above the frontier" in table
    efficiency.plot_task(rows, "t", tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 10_000


def test_results_are_appended_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "results.csv"
    for r in static_rows()[:3]:
        efficiency.append_row(path, r)
    back = efficiency.read_rows(path)
    assert [r["run_id"] for r in back] == [r["run_id"] for r in static_rows()[:3]]
    assert back[0]["batch"] == 16 and back[0]["metric_value"] == pytest.approx(0.52) and back[0]["target"] is None


@pytest.mark.slow
def test_quick_study_runs_every_configuration_and_resumes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env.update(PYTHONPATH=str(REPO), WANDB_MODE="disabled", OMP_NUM_THREADS="2")
    out = tmp_path / "study"
    # a fifth of the quick budgets; the text task on the email package only, tokenized into tmp_path
    args = [sys.executable, str(SCRIPT), "--quick", "--budget-scale", "0.2", "--out", str(out),
            "--override", "bert_tiny_stdlib:data.files=email/**/*.py",
            "--override", "bert_tiny_stdlib:data.val_fraction=0.2",
            "--override", f"bert_tiny_stdlib:data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    for name in efficiency.TASKS:
        task_rows = [r for r in rows if r["task"] == name]
        b0 = efficiency.with_recipe_defaults(efficiency.TASKS[name], []).smallest_batch  # B0 as the recipe sets it
        static_batches = {int(r["batch"]) for r in task_rows if r["method"] == "static"}
        assert static_batches == {b0 * 2**i for i in range(efficiency.SIZES)}
        methods = sorted(r["method"] for r in task_rows if r["method"] != "static")
        assert methods == ["noise_scale", "paper", "paper", "ramp_doubling", "ramp_linear"]
        assert all(math.isfinite(float(r["metric_value"])) and int(r["steps"]) > 0 for r in task_rows)
        assert all(int(r["samples"]) == int(r["budget"]) for r in task_rows)  # every run ends on its budget exactly
        assert (out / f"efficiency_{name}.png").stat().st_size > 10_000
        assert f"## {name}" in (out / "summary.md").read_text()
    assert "runs trained in" in proc.stdout
    # run again: everything is in the CSV already, nothing is trained
    again = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "\n0 runs trained in" in again.stdout, again.stdout[-2000:]


def test_the_grid_widens_past_an_edge_and_fills_in_new_seeds() -> None:
    task = efficiency.with_recipe_defaults(efficiency.TASKS["digits"], [])
    rows = [dict(r, task="digits", budget=1000) for r in static_rows()]
    for r in rows:  # run ids as the plan names them, so that the plan sees what is done
        run = efficiency.static_runs(task, "digits", [r["batch"]], [r["lr_mult"]], [r["seed"]], 1000)[0]
        r["run_id"] = run.run_id
    # B=64's best rate is the grid's largest (x2): x4 is added; B=16 and B=32 have theirs inside the grid
    added = efficiency.widen_grid(task, "digits", rows, [16, 32, 64], [0, 1], 1000)
    assert {(r.batch, r.lr_mult) for r in added} == {(64, 4)} and {r.seed for r in added} == {0, 1}
    # a new seed gets every rate its batch has been tried at
    more = efficiency.widen_grid(task, "digits", rows, [16], [2], 1000)
    assert sorted(r.lr_mult for r in more) == [0.5, 1, 2] and all(r.seed == 2 for r in more)


def test_a_studywide_override_moves_the_grid_centre_and_each_run_keeps_its_own_rate(tmp_path: Path) -> None:
    extra = ["optimizer.lr=0.04", "num_threads=1"]
    task = efficiency.with_recipe_defaults(efficiency.TASKS["digits"], extra)
    assert task.lr0 == pytest.approx(0.04)  # the grid is centred on the override ...
    runs = efficiency.static_runs(task, "digits", [64], [0.5, 2], [0], 5000)
    for run in runs:  # ... and every run trains at its own rate of that grid, not at the override
        cfg = efficiency.compose_run(task, run, tmp_path, extra, "none")
        assert cfg.optimizer.lr == pytest.approx(0.04 * math.sqrt(64 / 16) * run.lr_mult, rel=1e-5)
        assert cfg.num_threads == 1
    assert len({efficiency.compose_run(task, r, tmp_path, extra, "none").optimizer.lr for r in runs}) == 2
