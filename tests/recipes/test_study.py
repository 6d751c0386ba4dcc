"""``benchmarks/study.py``: the arms, the reading of a run's curve, the choices the protocol makes, the paired
intervals, the probe's timing, and (slow) every stage on small budgets."""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "study.py"
sys.path.insert(0, str(REPO / "benchmarks"))
spec = importlib.util.spec_from_file_location("study", SCRIPT)
assert spec is not None and spec.loader is not None
study = importlib.util.module_from_spec(spec)
sys.modules["study"] = study
spec.loader.exec_module(study)


def curve(points: list[tuple[float, float]], per_step: int = 16) -> list[dict[str, float]]:
    """A validation curve from (steps, metric) pairs: samples = steps x per_step, one CPU second per 10 steps."""
    return [
        {
            "validation": i + 1,
            "steps": s,
            "samples": s * per_step,
            "tokens": s * per_step,
            "train_cpu_s": s / 10,
            "train_wall_s": s / 5,
            "metric": m,
            "accuracy": 1 - m,
        }  # fmt: skip
        for i, (s, m) in enumerate(points)
    ]


def run(task: str, arm: str, kind: str, seed: int, final: float, points: list[tuple[float, float]], batch: int = 16,
        lr_mult: float = 1.0) -> tuple[dict, list[dict[str, float]]]:  # fmt: skip
    run_id = f"{task}-{arm}-s{seed}"
    row = {"run_id": run_id, "stage": "select", "task": task, "arm": arm, "kind": kind, "batch": batch,
           "lr": 0.01 * lr_mult, "lr_mult": lr_mult, "seed": seed, "budget": 1000, "metric_value": final,
           "accuracy_value": 1 - final, "steps": int(points[-1][0]),
           "overrides": f"a=1 optimizer.lr={0.01 * lr_mult}"}  # fmt: skip
    return row, curve([*points[:-1], (points[-1][0], final)])


def digits_rows() -> tuple[list[dict], dict[str, list[dict[str, float]]]]:
    """Selection rows of one task (margin 0.003): B=16 is best (0.030 -> target 0.033), B=64 reaches it faster but
    ends worse, a fast ramp ends worse, a slower ramp is eligible; candidates: one eligible, one faster but worse."""
    out = [
        run("digits", "static-B16-x1", "static", s, 0.030, [(100, 0.1), (500, 0.034), (1000, 0.030)]) for s in (10, 11)
    ]
    out += [run("digits", "static-B16-x2", "static", s, 0.040, [(100, 0.1), (1000, 0.040)]) for s in (10, 11)]
    out += [run("digits", "static-B64-x1", "static", s, 0.0325, [(25, 0.1), (200, 0.032), (250, 0.0325)], batch=64)
            for s in (10, 11)]  # fmt: skip
    out += [run("digits", "ramp-fast", "ramp", s, 0.040, [(20, 0.1), (50, 0.032), (60, 0.040)]) for s in (10, 11)]
    out += [run("digits", "ramp-good", "ramp", s, 0.031, [(50, 0.1), (150, 0.033), (200, 0.031)]) for s in (10, 11)]
    out += [run("digits", "cand-good", "candidate", s, 0.031, [(50, 0.1), (165, 0.033), (200, 0.031)])
            for s in (10, 11)]  # fmt: skip
    out += [run("digits", "cand-bad", "candidate", s, 0.050, [(50, 0.1), (100, 0.032), (110, 0.05)]) for s in (10, 11)]
    return [r for r, _ in out], {r["run_id"]: c for r, c in out}


def test_a_run_reaches_the_target_between_its_validations() -> None:
    c = curve([(10, 1.0), (20, 0.5), (30, 0.2)])
    hit = study.crossing(c, 0.75)  # halfway between the first two validations
    assert hit == pytest.approx({"steps": 15, "samples": 240, "tokens": 240, "train_cpu_s": 1.5, "train_wall_s": 3.0})
    assert study.crossing(c, 0.1) is None  # never reached
    assert study.crossing(c, 2.0)["steps"] == 10  # already there at the first validation


def test_the_grids_and_the_ramps() -> None:
    assert study.static_sizes(16, 9) == [16, 23, 32, 45, 64, 91, 128, 181, 256]
    assert study.static_sizes(4096, 3) == [4096, 5793, 8192]
    shapes = dict(study.ramp_shapes(study.TASKS["digits"], 16, 1200))
    assert len(shapes) == 9 and "simigrad.over=300" in shapes["linear-to64-over-quarter"]
    assert "simigrad.at=[400,800]" in shapes["doubling-to64"]  # two doublings, evenly spaced over the budget
    arms = study.ramp_arms(study.TASKS["digits"], 16, 1200, 0.5)
    assert len(arms) == 18 and {a.overrides[-1] for a in arms} == {
        "simigrad.lr_scaling=sqrt",
        "simigrad.lr_scaling=linear",
    }
    task = study.efficiency.Task("digits", "val/loss", "val/acc1", (0.3, 0.3), 1, 1, smallest_batch=16, lr0=0.01)
    assert study.static_arm(64, 2).lr(task) == pytest.approx(0.01 * 2 * 2)  # lr0 sqrt(64 / 16) x 2
    assert arms[0].lr(task) == pytest.approx(0.005)  # adaptive arms: B0's rate x its multiplier
    cands = study.candidate_arms(16, 1.0)
    assert [a.name for a in cands] == list(study.CANDIDATES)
    assert all("simigrad.initial_batch_size=16" in a.overrides and "simigrad=paper" in a.overrides for a in cands)


def test_the_static_grid_widens_past_an_edge() -> None:
    rows = [r for r, _ in (run("digits", f"static-B16-x{m:g}", "static", 10, loss, [(10, loss)], lr_mult=m)
                           for m, loss in ((0.5, 0.3), (1, 0.2), (2, 0.1)))]  # fmt: skip
    assert [(a.batch, a.lr_mult) for a in study.widen(rows, [16])] == [(16, 4)]
    rows[1]["metric_value"] = 0.05  # best inside the grid: nothing to add
    assert study.widen(rows, [16]) == []


def test_the_selection_fixes_the_target_and_picks_eligible_arms() -> None:
    rows, curves = digits_rows()
    sel = study.Selection(rows, curves, study.TASKS["digits"])
    assert sel.target == pytest.approx(0.033) and sel.best_static.arm == "static-B16-x1"
    assert sel.fastest_static.arm == "static-B64-x1"  # reaches 0.033 before 200 steps and ends within it
    assert sel.best_ramp.arm == "ramp-good"  # the fast ramp ends at 0.040 > 0.033: not eligible
    assert not sel.eligible(sel.ramps["ramp-fast"]) and sel.eligible(sel.candidates["cand-good"])
    assert sel.steps(sel.best_ramp) == pytest.approx(150)


def test_the_default_is_the_lowest_score_among_candidates_eligible_everywhere() -> None:
    rows, curves = digits_rows()
    scores = study.candidate_scores(rows, curves)
    assert scores["cand-good"]["ratios"]["digits"] == pytest.approx(165 / 150)
    assert scores["cand-bad"]["ratios"]["digits"] < scores["cand-good"]["ratios"]["digits"]  # faster, but worse
    winner, table = study.choose(rows, curves)
    assert winner == "cand-good" and "cand-bad" in table and "(not eligible)" in table


def test_paired_intervals_are_per_seed() -> None:
    a = study.Group("a", [{"seed": s, "metric_value": 0.5 + 0.01 * s} for s in range(4)])
    b = study.Group("b", [{"seed": s, "metric_value": 0.4 + 0.01 * s} for s in range(4)])
    reach = {"a": {s: {"steps": 200.0, "train_cpu_s": 20.0} for s in range(4)},
             "b": {s: {"steps": 100.0 + s, "train_cpu_s": 10.0} for s in range(4)}}  # fmt: skip
    reach["b"][3] = None  # b misses the target on seed 3: steps compare on the three seeds both reach it
    p = study.paired(a, b, reach)
    assert p["seeds"] == 4 and p["both_reach"] == 3
    mean, low, high = p["final"]
    assert mean == pytest.approx(0.1) and low == pytest.approx(0.1) and high == pytest.approx(0.1)
    m, lo, hi = p["log_steps"]
    assert math.exp(m) == pytest.approx((2 * 200 / 101 * 200 / 102) ** (1 / 3)) and lo < m < hi
    assert math.exp(p["log_cpu"][0]) == pytest.approx(2.0)


def test_the_probe_leaves_validations_out_of_the_training_time(tmp_path: Path, monkeypatch) -> None:
    import study_probe

    clock = [0.0]
    monkeypatch.setattr(study_probe.time, "process_time", lambda: clock[0])
    monkeypatch.setattr(study_probe.time, "perf_counter", lambda: 2 * clock[0])
    probe = study_probe.Probe(str(tmp_path))
    for t, metrics in ((1.0, {"simigrad/samples_seen": 16}), (2.0, {"simigrad/samples_seen": 32}),
                       (5.0, {"val/loss": 0.5}),  # three seconds of validation
                       (6.0, {"simigrad/samples_seen": 48}), (7.0, {"val/loss": 0.4})):  # fmt: skip
        clock[0] = t
        probe.log_metrics(metrics, step=0)
    probe.finalize("success")
    with (tmp_path / "curve.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["steps"]), float(r["samples"]), float(r["train_cpu_s"])) for r in rows] == [
        (2, 32, 2.0),
        (3, 48, 3.0),
    ]
    assert float(rows[0]["val_cpu_s"]) == 3.0 and float(rows[1]["train_wall_s"]) == 6.0


@pytest.mark.slow
def test_quick_study_runs_every_stage_and_resumes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env.update(PYTHONPATH=str(REPO), WANDB_MODE="disabled")
    out = tmp_path / "study"
    data = ("data.files=email/**/*.py", "data.val_fraction=0.2", f"data.cache_dir={tmp_path / 'cache'}")
    small = [f"--override={t}:{o}" for t in ("bert_tiny_stdlib", "gpt_tiny_stdlib") for o in data]
    args = [sys.executable, str(SCRIPT), "all", "--quick", "--out", str(out), *small]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    for name in study.TASKS:
        kinds = sorted(r["kind"] for r in rows if r["task"] == name and r["stage"] == "select")
        assert kinds == ["candidate"] * 2 + ["ramp"] * 2 + ["static"] * 2
        judged = {r["kind"] for r in rows if r["task"] == name and r["stage"] == "judge"}
        assert {"default", "replay", "ramp", "static"} <= judged
        assert all(int(r["validations"]) >= 2 and float(r["train_cpu_s"]) > 0 for r in rows if r["task"] == name)
    assert f"## {name}: judging seeds" in (out / "study.md").read_text()
    again = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "\n0 runs trained in" in again.stdout, again.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="--jobs 2 needs two cores")
def test_runs_trained_side_by_side_give_the_rows_of_runs_trained_one_at_a_time(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env.update(PYTHONPATH=str(REPO), WANDB_MODE="disabled")
    rows = {}
    for jobs in (1, 2):
        out = tmp_path / f"jobs{jobs}"
        args = [sys.executable, str(SCRIPT), "select", "--quick", "--tasks", "digits", "--parts", "static",
                "--seeds", "10,11", "--jobs", str(jobs), "--out", str(out)]  # fmt: skip
        proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        with (out / "results.csv").open() as f:
            rows[jobs] = {r["run_id"]: r for r in csv.DictReader(f)}
        with (out / "curves.csv").open() as f:
            curves = [c["run_id"] for c in csv.DictReader(f)]
        assert sorted(set(curves)) == sorted(rows[jobs])  # every row's curve, appended once per validation
        assert len(curves) == sum(int(r["validations"]) for r in rows[jobs].values())
    assert len(rows[2]) == 4 and rows[2].keys() == rows[1].keys()
    for run_id, one in rows[1].items():  # a run's result does not depend on what trains beside it
        assert (rows[2][run_id]["metric_value"], rows[2][run_id]["steps"]) == (one["metric_value"], one["steps"])


def test_jobs_beyond_the_cores_are_refused(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "select", "--jobs", str((os.cpu_count() or 1) + 1),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "--jobs" in proc.stderr and "cores" in proc.stderr


def test_the_verdict_needs_as_many_seeds_steps_within_five_percent_and_no_worse_quality() -> None:
    def group(name: str, finals: list[float]) -> study.Group:
        return study.Group(name, [{"seed": s, "metric_value": f} for s, f in enumerate(finals)])

    default, ramp = group("default", [0.50, 0.52, 0.49]), group("ramp", [0.51, 0.50, 0.50])
    reach = {"default": {s: {"steps": 104.0, "train_cpu_s": 1.0} for s in range(3)},
             "ramp": {s: {"steps": 100.0, "train_cpu_s": 1.0} for s in range(3)}}  # fmt: skip
    assert "**met**" in study.verdict(default, ramp, reach)  # 4% more steps, final within the noise
    reach["default"] = {s: {"steps": 110.0, "train_cpu_s": 1.0} for s in range(3)}
    assert "over 1.05" in study.verdict(default, ramp, reach)
    reach["default"][2] = None
    assert "**not met**" in study.verdict(default, ramp, reach) and "fewer" in study.verdict(default, ramp, reach)
    reach["default"] = {s: {"steps": 90.0, "train_cpu_s": 1.0} for s in range(3)}
    worse = group("default", [0.60, 0.61, 0.62])
    assert "(worse)" in study.verdict(worse, ramp, reach)


def test_with_no_candidate_eligible_everywhere_the_fallback_is_eligible_on_the_most_tasks() -> None:
    rows, curves = digits_rows()
    task = "bert_tiny_stdlib"  # margin 0.02: best static 5.20 -> target 5.22; no candidate reaches it on both seeds
    more = [run(task, "static-B16-x1", "static", s, 5.20, [(100, 6.0), (1500, 5.20)]) for s in (10, 11)]
    for cand in ("cand-good", "cand-bad"):  # seed 10 never below 5.25, seed 11 reaches 5.22 at step 900
        more += [run(task, cand, "candidate", 10, 5.3, [(100, 6.0), (900, 5.25), (1000, 5.3)])]
        more += [run(task, cand, "candidate", 11, 5.2, [(100, 6.0), (900, 5.22), (1000, 5.2)])]
    rows += [r for r, _ in more]
    curves |= {r["run_id"]: c for r, c in more}
    winner, table = study.choose(rows, curves)
    assert winner is None and "on 1/2 seeds" in table
    assert study.fallback(rows, curves) == "cand-good"  # eligible on digits, where cand-bad is not
