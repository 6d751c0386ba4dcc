"""The critical batch of the digits task, measured directly, beside the noise scale SimiGrad logs and its batch.

    python benchmarks/critical_batch.py                          # ~3 minutes on 2 CPU cores
    python benchmarks/critical_batch.py --seeds 0,1,2 --study outputs/study_digits --out outputs/critical_batch
    python benchmarks/critical_batch.py --from-study outputs/study --arm ratchet-0.333-linear --out outputs/cb
        # no training: the static curves of benchmarks/study.py's selection seeds (a sqrt(2) grid, each batch at
        # its best rate, 48 validations a run), and the noise scale and batch of one of its SimiGrad arms

McCandlish et al. (2018, "An Empirical Model of Large-Batch Training") measure the critical batch from static
runs: for a fixed target loss, a batch B needs S(B) optimizer steps and E(B) = B S(B) samples, and across B these
follow ``(S / S_min - 1)(E / E_min - 1) = 1``, i.e. ``S(B) = S_min + E_min / B``; the critical batch is
``B_crit = E_min / S_min``, the batch at which twice the fewest steps and twice the fewest samples are spent.

Here each static batch B = 16 .. 512 of the efficiency study trains at its best learning rate (read from the study's
``results.csv``; x1 where none is there) with the validation loss read 8 times per epoch (``logger=csv``). For each
of several target losses, the first validation that reaches it gives S(B) and E(B) (mean over seeds; a batch that
never reaches a target is left out of that target's fit); ``S = S_min + E_min / B`` is fitted by least squares over
the batches that reach it, and ``B_crit = E_min / S_min`` is placed at the samples the smallest batch needed for it
(the point of training the target stands for). The figure puts these points beside ``simigrad/noise_scale`` and
SimiGrad's batch, against samples seen, from the study's SimiGrad runs (the paper rule at tau = 0.3, the recipe),
whose traces ``--study`` holds; the table gives their medians at the samples each target stands for. The table is
printed and written as ``critical_batch.md``, with the data behind it and the figure: ``critical_batch_curves.csv``
(every validation of every static run), ``critical_batch_fit.csv`` (per target, each batch's mean steps and the
fit) and ``critical_batch_traces.csv`` (the SimiGrad traces the figure draws).

The critical batch depends on the target and on the learning-rate schedule (the recipe's cosine decay over the
12 epochs, the same for every batch), so the points are the critical batch *of this recipe* at those targets; the
noise scale is the quantity McCandlish et al. predict it to track, ``B_crit ~ B_noise``.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("efficiency", HERE / "efficiency.py")
assert _spec is not None and _spec.loader is not None
efficiency = importlib.util.module_from_spec(_spec)
sys.modules["efficiency"] = efficiency
_spec.loader.exec_module(efficiency)

SIZES = (16, 32, 64, 128, 256, 512)
TARGETS = (0.30, 0.15, 0.10, 0.07, 0.05, 0.04, 0.035, 0.03)


def best_rates(study: Path) -> dict[int, float]:
    """Each static batch's best LR multiplier in the study (mean over its seeds)."""
    rows = efficiency.read_rows(study / "results.csv")
    best = efficiency.best_static(efficiency.group_rows(r for r in rows if r["method"] == "static").values())
    return {b: g.first["lr_mult"] for b, g in best.items()}


def validation_curve(run_dir: Path, batch: int) -> list[tuple[int, int, float]]:
    """(optimizer steps, samples, val loss) at every validation of a static run, from its CSV log."""
    (metrics,) = run_dir.glob("logs/version_*/metrics.csv")
    with metrics.open() as f:
        points = [(int(r["step"]), float(r["val/loss"])) for r in csv.DictReader(f) if r.get("val/loss")]
    return [(step, step * batch, loss) for step, loss in points]


def train_static(task: Any, batch: int, mult: float, seed: int, out: Path) -> list[tuple[int, int, float]]:
    from lightning_simigrad_recipes.train import train

    (run,) = efficiency.static_runs(task, "digits", [batch], [mult], [seed], task.budget)
    run_dir = out / "runs" / run.run_id
    if not list(run_dir.glob("logs/version_*/metrics.csv")):
        extra = ["num_threads=1", "logger=csv", "+trainer.val_check_interval=0.125"]
        cfg = efficiency.compose_run(task, run, out, extra, "none")
        cfg.output_dir = str(run_dir)
        train(cfg)
    return validation_curve(run_dir, batch)


def first_reach(curve: list[tuple[int, int, float]], target: float) -> tuple[int, int] | None:
    for steps, samples, loss in curve:
        if loss <= target:
            return steps, samples
    return None


def fit(points: dict[int, float]) -> tuple[float, float]:
    """Least squares of S = S_min + E_min / B over {B: S}: (S_min, E_min)."""
    xs, ys = [1 / b for b in points], list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def simigrad_traces(study: Path) -> list[list[dict[str, float]]]:
    traces = []
    for trace in sorted((study / "runs" / "digits").glob("digits-paper-B16-*-tau0.3-*/simigrad_trace.csv")):
        with trace.open() as f:
            traces.append([{k: float(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(f)])
    return traces


def at_samples(traces: list[list[dict[str, float]]], samples: float, key: str) -> float:
    """The median over SimiGrad's runs of ``key`` at the first step that reached ``samples`` (NaN: no trace)."""
    values = []
    for trace in traces:
        row = next((r for r in trace if r["samples_seen"] >= samples), None)
        if row is not None and math.isfinite(row.get(key, math.nan)):
            values.append(row[key])
    return statistics.median(values) if values else math.nan


Curves = dict[int, list[list[tuple[int, int, float]]]]  # per batch, per run: (steps, samples, val loss)


def study_curves(study_out: Path, arm: str | None) -> tuple[Curves, list[list[dict[str, float]]], dict[int, float]]:
    """From ``benchmarks/study.py``'s results: each static batch's curves at its best rate (selection seeds), the
    traces of ``arm``'s runs there, and each batch's rate multiplier."""
    sys.path.insert(0, str(HERE))
    import study

    rows, curves = study.read_results(study_out)
    rows = [r for r in rows if r["task"] == "digits" and r["stage"] == "select" and r["budget"] == study.TASKS[
        "digits"].base.budget]  # fmt: skip
    best = study.best_per_batch(rows)
    out = {
        b: [
            [(int(p["steps"]), int(p["samples"]), p["metric"]) for p in curves[r["run_id"]]]
            for r in sorted(g.rows, key=lambda r: r["seed"])
        ]
        for b, g in best.items()
    }
    traces = []
    for r in sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["seed"]):
        with (Path(r["run_dir"]) / "simigrad_trace.csv").open() as f:
            traces.append([{k: float(v) for k, v in t.items() if v not in ("", None)} for t in csv.DictReader(f)])
    return out, traces, {b: g.lr_mult for b, g in best.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--study", default="outputs/study_digits", help="the efficiency study's --out (rates, traces)")
    p.add_argument("--from-study", default=None, help="benchmarks/study.py's --out: its static curves, no training")
    p.add_argument("--arm", default=None, help="with --from-study: the SimiGrad arm whose traces are drawn")
    p.add_argument("--out", default="outputs/critical_batch")
    args = p.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_study:
        curves, traces, rates = study_curves(Path(args.from_study), args.arm)
        label = f"SimiGrad ({args.arm})"
    else:
        study = Path(args.study)
        task = efficiency.with_recipe_defaults(efficiency.TASKS["digits"], [])
        rates = best_rates(study) if (study / "results.csv").is_file() else {}
        seeds = [int(s) for s in args.seeds.split(",")]
        curves = {b: [train_static(task, b, rates.get(b, 1.0), s, out) for s in seeds] for b in SIZES}
        traces = simigrad_traces(study)
        label = "SimiGrad (paper rule, tau = 0.3)"
    smallest = min(curves)
    with (out / "critical_batch_curves.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["batch", "lr_mult", "run", "steps", "samples", "val_loss"])
        for b, runs in curves.items():
            for i, c in enumerate(runs):
                w.writerows([b, rates.get(b, 1.0), i, steps, samples, loss] for steps, samples, loss in c)
    with (out / "critical_batch_traces.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "samples_seen", "batch_size", "noise_scale"])
        for i, t in enumerate(traces):
            w.writerows([i, r["samples_seen"], r["batch_size"], r.get("noise_scale", math.nan)] for r in t)

    lines = [
        "| target val loss | batches reaching it (B: S steps) | S_min | E_min | B_crit = E_min / S_min"
        f" | E({smallest}) | B_noise logged there | {label}'s batch there |",
        "|---|---|---|---|---|---|---|---|",
    ]
    found = []
    fit_rows = []
    for target in TARGETS:
        reached = {}
        for b, runs in curves.items():
            hits = [first_reach(c, target) for c in runs]
            if all(h is not None for h in hits):
                reached[b] = statistics.fmean(h[0] for h in hits if h is not None)
        if len(reached) < 3 or min(reached) != smallest:
            lines.append(f"| {target:g} | {len(reached)} batches reach it: no fit | | | | | | |")
            continue
        s_min, e_min = fit(reached)
        where = reached[smallest] * smallest
        b_crit = e_min / s_min if s_min > 0 else math.inf
        found.append((target, where, b_crit))
        fit_rows += [[target, b, s, s * b, s_min, e_min, b_crit] for b, s in reached.items()]
        shown = ", ".join(f"{b}: {s:.0f}" for b, s in reached.items())
        noise, batch = at_samples(traces, where, "noise_scale"), at_samples(traces, where, "batch_size")
        lines.append(
            f"| {target:g} | {shown} | {s_min:.1f} | {e_min:.0f} | {b_crit:.0f} | {where:.0f}"
            f" | {noise:.0f} | {batch:.0f} |"
        )
    with (out / "critical_batch_fit.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["target", "batch", "mean_steps", "mean_samples", "S_min", "E_min", "B_crit"])
        w.writerows(fit_rows)
    table = "\n".join(lines)
    print(table)
    (out / "critical_batch.md").write_text(table + "\n")
    plot(found, traces, out / "critical_batch.png", label)
    print(f"figure: {out / 'critical_batch.png'}")
    return 0


def plot(found: list[tuple[float, float, float]], traces: list[list[dict[str, float]]], path: Path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, trace in enumerate(traces):
        samples = [r["samples_seen"] for r in trace]
        ax.plot(samples, [r["batch_size"] for r in trace], color="tab:blue", alpha=0.5, linewidth=0.8,
                label=f"{label}'s batch" if i == 0 else None)  # fmt: skip
        noise = [(s, r["noise_scale"]) for s, r in zip(samples, trace) if math.isfinite(r.get("noise_scale", math.nan))]
        ax.plot([s for s, _ in noise], [n for _, n in noise], color="tab:orange", alpha=0.5, linewidth=0.8,
                label="logged noise scale B_noise" if i == 0 else None)  # fmt: skip
    finite = [(w, b, t) for t, w, b in found if math.isfinite(b) and b > 0]
    ax.plot([w for w, _, _ in finite], [b for _, b, _ in finite], "ks", label="critical batch, static runs (fit)")
    for w, b, t in finite:
        ax.annotate(f"loss {t:g}", (w, b), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("samples seen")
    ax.set_ylabel("batch size")
    ax.set_title("digits: the critical batch measured, the noise scale logged")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
