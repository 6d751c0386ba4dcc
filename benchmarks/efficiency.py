"""Does SimiGrad beat every static batch size? Final metric against optimizer steps at a fixed sample budget.

    python benchmarks/efficiency.py                  # the full study: both tasks, 3 seeds (hours on 2 CPU cores)
    python benchmarks/efficiency.py --quick          # one seed, the sqrt-scaled LR only, small budgets (< 10 min)
    python benchmarks/efficiency.py --tasks digits --seeds 0,1 --sizes 16,64,256 \
        --variant "linear:simigrad.lr_scaling=linear" --out outputs/efficiency_linear   # a reduced study

For each task (a recipe of ``conf/experiment``) every run trains on the same number of samples
(``simigrad.max_samples``), from the same initial weights for a given seed:

- **static**: a fixed batch B over powers of two from the task's smallest batch B0, each with learning
  rates ``lr0 sqrt(B / B0) x {1/2, 1, 2}`` (``--lr-grid``), where ``lr0`` is the recipe's rate at B0. The
  static runs are ``simigrad=off`` (``SimiGrad(adjust=False)``): the same micro-batches and accumulation as
  the adaptive runs, and the similarity still measured, but the batch and the LR never move. Each B keeps its
  best rate (mean over seeds); where that rate is the grid's smallest or largest, the grid is widened by one
  more factor of 2 that way (``--extend`` times), so the baseline's rate is not cut off by the grid.
- **SimiGrad**: the paper rule at the task's two targets and the noise-scale rule, each started from B0 with
  B0's best learning rate; ``--variant NAME:OVERRIDES`` adds more (Hydra overrides, space-separated).
- **Ramps** (``simigrad=ramp``, what large-scale users pick instead of an adaptive batch): GPT-3's linear ramp
  from B0 to 4, 16 or 64 B0 over a quarter or half of the budget, and OLMo's doublings from B0, 2, 4 or 6 of
  them evenly spaced over the budget; from B0's best rate, with the recipe's LR scaling, as SimiGrad
  (``--no-ramps`` leaves them out, ``--ramps to64,to64-over-half`` runs only those). Choose the best ramp on
  tuning seeds and judge it on others (``--seeds``), as every other method's settings; ``--simigrad`` likewise
  runs only the SimiGrad configurations it names (``--simigrad paper-tau0.3,linear``).

Written into ``--out``: ``results.csv`` (one row per run, appended as runs finish: an interrupted study
resumes where it stopped and skips the runs already there), ``efficiency_<task>.png`` (metric against steps:
the static frontier with error bars, SimiGrad and the ramps as points, and their batch-size traces), the printed
table as ``summary.md``, and each run's folder with its SimiGrad trace.

Budgets end each run exactly (``simigrad.max_samples``). Schedules: a task whose budget is whole epochs (digits)
runs its recipe's epoch-based schedule over them; ``--schedule linear`` decays the LR linearly to 0 over the
budget with ``scheduler=warmup_linear``, which SimiGrad advances by samples (B / B0 per step), so a static
run and an adaptive one follow the same schedule per sample.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# The recipes are imported in `run_one` only (and their config folder in `compose_run`): the analysis
# and the figure work without Hydra or the recipes installed.


@dataclass(frozen=True)
class Task:
    """A recipe under study and how its runs are compared."""

    experiment: str
    metric: str  # the final validation metric the study compares; lower is better
    accuracy: str  # reported beside it
    targets: tuple[float, float]  # the paper rule's two targets; the noise-scale rule uses the first
    budget: int  # training samples per run
    quick_budget: int
    # samples per epoch when a budget is whole epochs: max_epochs is then set to match, so that epoch-based
    # schedules (cosine over max_epochs) span the budget; otherwise the budget alone ends the run
    epoch_samples: int | None = None
    overrides: tuple[str, ...] = ()
    # read from the recipe (`simigrad.initial_batch_size`, `optimizer.lr`) by `with_recipe_defaults`
    smallest_batch: int = 0  # B0: the smallest static batch and SimiGrad's starting batch
    lr0: float = 0.0  # the recipe's learning rate at B0 (the centre of B0's grid)


TASKS = {
    "digits": Task(
        experiment="digits",
        metric="val/loss",
        accuracy="val/acc1",
        targets=(0.3, 0.5),
        budget=12 * 1437,  # 12 epochs of the 1437 training images (val accuracy has levelled off by then)
        quick_budget=4 * 1437,
        epoch_samples=1437,
    ),
    "bert_tiny_stdlib": Task(
        experiment="bert_tiny_stdlib",
        metric="val/loss",
        accuracy="val/mlm_acc",
        targets=(0.3, 0.8),
        budget=24_000,  # ~0.36 epoch: no sequence is seen twice
        quick_budget=4_000,
    ),
}
SIZES = 6  # static batch sizes: B0, 2 B0, ..., 32 B0
COMMON = ("logger=none", "trainer.enable_progress_bar=false", "trainer.enable_checkpointing=false")
COLUMNS = [
    "run_id", "task", "method", "variant", "batch", "lr", "lr_mult", "target", "seed", "budget",
    "metric", "metric_value", "accuracy", "accuracy_value", "steps", "mean_batch", "samples",
    "final_batch", "batch_over_bstar", "at_cap", "wall_s", "cpu_s", "run_dir",
]  # fmt: skip


@dataclass
class Run:
    """One configuration at one seed; ``run_id`` names it in the CSV."""

    task: str
    method: str  # "static", "paper", "noise_scale" or a variant's name
    batch: int  # the static batch, or SimiGrad's starting batch B0
    lr_mult: float  # the LR relative to lr0 sqrt(B / B0)
    lr: float  # the learning rate at the start
    target: float | None
    seed: int
    budget: int
    overrides: list[str] = field(default_factory=list)
    variant: str = ""

    @property
    def run_id(self) -> str:
        target = f"tau{self.target:g}" if self.target is not None else "static" if self.method == "static" else "fixed"
        variant = f"-{self.variant}" if self.variant else ""
        return f"{self.task}-{self.method}{variant}-B{self.batch}-lr{self.lr:.4g}-{target}-n{self.budget}-s{self.seed}"


# ------------------------------------------------------------------------------------------- the plan
def static_runs(
    task: Task, name: str, sizes: list[int], lr_grid: list[float], seeds: list[int], budget: int
) -> list[Run]:
    runs = []
    for b in sizes:
        for mult in lr_grid:
            lr = task.lr0 * math.sqrt(b / task.smallest_batch) * mult
            overrides = [
                "simigrad=off",
                f"simigrad.initial_batch_size={b}",
                f"simigrad.min_batch_size={b}",
                f"simigrad.max_batch_size={b}",
                f"optimizer.lr={lr:.6g}",
            ]
            runs += [Run(name, "static", b, mult, float(f"{lr:.6g}"), None, s, budget, overrides) for s in seeds]
    return runs


def widen_grid(
    task: Task, name: str, rows: list[dict[str, Any]], sizes: list[int], seeds: list[int], budget: int
) -> list[Run]:
    """One more rate beyond the edge for each batch whose best rate is the grid's smallest or largest.

    Rates an earlier (resumed) study added for a batch are run for these seeds too, so every rate of a
    batch has the same seeds.
    """
    static = [r for r in rows if r["task"] == name and r["method"] == "static" and r["budget"] == budget]
    runs = []
    for b, best in best_static(group_rows(r for r in static if r["batch"] in sizes).values()).items():
        tried = sorted({r["lr_mult"] for r in static if r["batch"] == b})
        m = best.first["lr_mult"]
        if len(tried) > 1 and m in (tried[0], tried[-1]):
            tried.append(m / 2 if m == tried[0] else m * 2)
        runs += static_runs(task, name, [b], tried, seeds, budget)
    done = {r["run_id"] for r in rows}
    return [r for r in runs if r.run_id not in done]


def simigrad_runs(
    task: Task, name: str, lr_mult: float, seeds: list[int], budget: int, variants: list[tuple[str, str]]
) -> list[Run]:
    b0 = task.smallest_batch
    base = [f"simigrad.initial_batch_size={b0}", f"optimizer.lr={task.lr0 * lr_mult:.6g}"]
    configs = [("paper", t, ["simigrad=paper", f"simigrad.target_similarity={t}"], "") for t in task.targets]
    configs.append(
        ("noise_scale", task.targets[0], ["simigrad=noise_scale", f"simigrad.target_similarity={task.targets[0]}"], "")
    )
    for vname, extra in variants:  # on top of the paper rule at the first target, unless they say otherwise
        configs.append(
            (
                "paper",
                task.targets[0],
                ["simigrad=paper", f"simigrad.target_similarity={task.targets[0]}", *extra.split()],
                vname,
            )
        )
    runs = []
    for method, target, overrides, variant in configs:
        target = _target_of(overrides, target)
        lr = float(f"{task.lr0 * lr_mult:.6g}")
        runs += [Run(name, method, b0, lr_mult, lr, target, s, budget, base + overrides, variant) for s in seeds]
    return runs


def ramp_runs(task: Task, name: str, lr_mult: float, seeds: list[int], budget: int, quick: bool) -> list[Run]:
    """Linear ramps (GPT-3) and doublings (OLMo) from B0 at B0's best rate; ``quick``: one of each."""
    b0 = task.smallest_batch
    base = [f"simigrad.initial_batch_size={b0}", f"optimizer.lr={task.lr0 * lr_mult:.6g}", "simigrad=ramp"]
    configs = []
    for factor in (4,) if quick else (4, 16, 64):
        for share, part in ((2, "half"),) if quick else ((4, "quarter"), (2, "half")):
            overrides = ["simigrad.kind=linear", f"simigrad.end={factor * b0}", f"simigrad.over={budget // share}"]
            configs.append(("ramp_linear", f"to{factor * b0}-over-{part}", overrides))
    for k in (2,) if quick else (2, 4, 6):
        at = ",".join(str(budget * i // (k + 1)) for i in range(1, k + 1))  # evenly spaced over the budget
        configs.append(("ramp_doubling", f"to{b0 * 2**k}", ["simigrad.kind=doubling", f"simigrad.at=[{at}]"]))
    lr = float(f"{task.lr0 * lr_mult:.6g}")
    return [
        Run(name, method, b0, lr_mult, lr, None, s, budget, base + overrides, variant)
        for method, variant, overrides in configs
        for s in seeds
    ]


def config_name(run: Run) -> str:
    """The name ``--ramps`` and ``--simigrad`` select a configuration by: its variant's name (every ramp has
    one: ``to64-over-quarter``, ``to256``), else ``<method>-tau<target>`` (``paper-tau0.3``)."""
    return run.variant or (f"{run.method}-tau{run.target:g}" if run.target is not None else run.method)


def select(runs: list[Run], names: str | None, what: str) -> list[Run]:
    """The runs of the configurations ``names`` (comma-separated), in that order; None: all of them."""
    if names is None:
        return runs
    wanted = [n for n in names.split(",") if n]
    known = list(dict.fromkeys(config_name(r) for r in runs))
    unknown = [n for n in wanted if n not in known]
    if unknown:
        sys.exit(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(known)}")
    return sorted((r for r in runs if config_name(r) in wanted), key=lambda r: wanted.index(config_name(r)))


def label(row: dict[str, Any]) -> str:
    """A configuration's name in the tables and figures."""
    variant = f"/{row['variant']}" if row["variant"] else ""
    return f"{row['method']}{variant}" + (f" tau={row['target']:g}" if row["target"] is not None else "")


def _target_of(overrides: list[str], default: float) -> float:
    values = [o.split("=", 1)[1] for o in overrides if o.startswith("simigrad.target_similarity=")]
    return float(values[-1]) if values else default


# ------------------------------------------------------------------------------------------- running
def with_recipe_defaults(task: Task, extra: list[str]) -> Task:
    """The task with B0 and its learning rate as the recipe (and any overrides) set them."""
    from hydra import compose, initialize_config_module

    from lightning_simigrad_recipes.train import CONFIG_MODULE

    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"experiment={task.experiment}", *task.overrides, *extra])
    return replace(task, smallest_batch=int(cfg.simigrad.initial_batch_size), lr0=float(cfg.optimizer.lr))


def compose_run(task: Task, run: Run, out: Path, extra: list[str], schedule: str) -> Any:
    from hydra import compose, initialize_config_module

    from lightning_simigrad_recipes.train import CONFIG_MODULE

    overrides = [
        f"experiment={task.experiment}",
        *COMMON,
        f"seed={run.seed}",
        f"simigrad.max_samples={run.budget}",
        # the sample budget ends every run; whole epochs of it also set max_epochs for epoch-based schedules
        f"trainer.max_epochs={math.ceil(run.budget / task.epoch_samples) if task.epoch_samples else -1}",
        f"output_dir={out / 'runs' / run.task / run.run_id}",
        *task.overrides,
        # `--override` before the run's own settings: a run's rate, batch and controller win over a study-wide
        # setting of the same key (which, for `optimizer.lr`, set the grid's centre lr0: `with_recipe_defaults`)
        *extra,
        *run.overrides,
    ]
    if schedule == "linear":  # over the budget's B0-steps, advanced by samples (trainer.estimated_stepping_batches)
        overrides += ["scheduler=warmup_linear", "scheduler.warmup_fraction=0", "model.scheduler_interval=step"]
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def run_one(task: Task, run: Run, out: Path, extra: list[str], schedule: str) -> dict[str, Any]:
    from lightning_simigrad_recipes.train import train

    cfg = compose_run(task, run, out, extra, schedule)
    start, cpu = time.perf_counter(), time.process_time()
    result = train(cfg)
    # wall time is what users wait for; CPU time (all threads) is steadier on a machine shared with others
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    metrics = result["metrics"]
    if task.metric not in metrics:
        raise RuntimeError(f"{run.run_id}: no {task.metric} in the run's metrics {sorted(metrics)}")
    return {
        "run_id": run.run_id,
        "task": run.task,
        "method": run.method,
        "variant": run.variant,
        "batch": run.batch,
        "lr": float(cfg.optimizer.lr),
        "lr_mult": run.lr_mult,
        "target": "" if run.target is None else run.target,
        "seed": run.seed,
        "budget": run.budget,
        "metric": task.metric,
        "metric_value": metrics[task.metric],
        "accuracy": task.accuracy,
        "accuracy_value": metrics.get(task.accuracy, math.nan),
        "steps": result["steps"],
        "mean_batch": result["samples_seen"] / result["steps"],
        "samples": result["samples_seen"],
        "final_batch": result["final_batch_size"],
        **tracking(result.get("trace_csv"), cfg.simigrad.target_similarity, cfg.simigrad.max_batch_size),
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "run_dir": result["output_dir"],
    }


def tracking(trace_csv: str | None, target: float, cap: int | None) -> dict[str, float]:
    """How the batch followed B* = 2 B_noise tau / (1 - tau) over the run's second half, and time at the cap.

    ``batch_over_bstar``: median of B / B* (1: on B*); ``at_cap``: share of all steps at ``max_batch_size``.
    """
    if not trace_csv or not Path(trace_csv).is_file():
        return {"batch_over_bstar": math.nan, "at_cap": math.nan}
    with open(trace_csv) as f:
        trace = [(float(r["batch_size"]), float(r["noise_scale"])) for r in csv.DictReader(f)]
    ratios = [
        b / (2 * ns * target / (1 - target)) for b, ns in trace[len(trace) // 2 :] if math.isfinite(ns) and ns > 0
    ]
    return {
        "batch_over_bstar": statistics.median(ratios) if ratios else math.nan,
        "at_cap": sum(b >= cap for b, _ in trace) / len(trace) if cap else 0.0,
    }


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    with path.open() as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key in ("batch", "seed", "budget", "steps", "samples", "final_batch"):
            row[key] = int(float(row[key]))
        for key in ("lr", "lr_mult", "metric_value", "accuracy_value", "mean_batch", "batch_over_bstar", "at_cap",
                    "wall_s", "cpu_s"):  # fmt: skip
            row[key] = float(row[key])
        row["target"] = float(row["target"]) if row["target"] != "" else None
    return rows


def append_row(path: Path, row: dict[str, Any]) -> None:
    new = not path.is_file()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow(row)


# ------------------------------------------------------------------------------------------- analysis
@dataclass
class Group:
    """The seeds of one configuration."""

    key: tuple[Any, ...]
    rows: list[dict[str, Any]]

    def mean(self, col: str) -> float:
        return statistics.fmean(r[col] for r in self.rows)

    def std(self, col: str) -> float:
        return statistics.stdev(r[col] for r in self.rows) if len(self.rows) > 1 else 0.0

    @property
    def first(self) -> dict[str, Any]:
        return self.rows[0]


def group_rows(rows: Iterable[dict[str, Any]]) -> dict[tuple[Any, ...], Group]:
    groups: dict[tuple[Any, ...], Group] = {}
    for r in rows:
        key = (r["task"], r["method"], r["variant"], r["batch"], r["lr_mult"], r["target"], r["budget"])
        groups.setdefault(key, Group(key, [])).rows.append(r)
    return groups


def best_static(groups: Iterable[Group]) -> dict[int, Group]:
    """Per static batch, the learning rate with the best mean metric (lowest)."""
    best: dict[int, Group] = {}
    for g in groups:
        if g.first["method"] != "static":
            continue
        b = g.first["batch"]
        if b not in best or g.mean("metric_value") < best[b].mean("metric_value"):
            best[b] = g
    return dict(sorted(best.items()))


def envelope(frontier: dict[int, Group]) -> list[tuple[float, float]]:
    """(steps, metric) of the static batches that improve on every batch taking fewer steps, by steps."""
    points, best, out = sorted((g.mean("steps"), g.mean("metric_value")) for g in frontier.values()), math.inf, []
    for steps, metric in points:
        if metric < best:
            out.append((steps, metric))
            best = metric
    return out


def static_steps_to_reach(frontier: dict[int, Group], metric: float, interpolate: bool = True) -> float | None:
    """Optimizer steps a static batch (at its best rate) needs for ``metric`` (None: none reaches it).

    Measured: the fewest steps of a batch that reached it. Interpolated (the default, and the stricter for
    SimiGrad): between the two batches that bracket it, linear in log(steps), as a batch between two powers
    of 2 would do.
    """
    env = envelope(frontier)
    for i, (steps, m) in enumerate(env):
        if m <= metric:
            if i == 0 or not interpolate:
                return steps
            s0, m0 = env[i - 1]
            frac = (m0 - metric) / (m0 - m)
            return math.exp(math.log(s0) + frac * (math.log(steps) - math.log(s0)))
    return None


def verdict(frontier: dict[int, Group], g: Group) -> dict[str, Any]:
    """Where one SimiGrad configuration stands against the static frontier."""
    best = min(frontier.values(), key=lambda s: s.mean("metric_value"))
    m, steps = g.mean("metric_value"), g.mean("steps")
    spread = max(best.std("metric_value"), g.std("metric_value"))
    reach = static_steps_to_reach(frontier, m)
    return {
        "best_static_batch": best.first["batch"],
        "best_static_metric": best.mean("metric_value"),
        "best_static_steps": best.mean("steps"),
        # reaches the best static metric within the seeds' spread
        "reaches_best": m <= best.mean("metric_value") + spread,
        # static steps needed for SimiGrad's own metric (None: no static batch reaches it)
        "static_steps_for_its_metric": reach,
        "static_steps_measured": static_steps_to_reach(frontier, m, interpolate=False),
        "above_frontier": reach is None or steps < reach,
    }


def summary_table(rows: list[dict[str, Any]], task: str) -> str:
    """The study's table for one task, in Markdown."""
    groups = [g for g in group_rows(r for r in rows if r["task"] == task).values()]
    frontier = best_static(groups)
    grid: dict[int, list[float]] = defaultdict(list)
    for g in groups:
        if g.first["method"] == "static":
            grid[g.first["batch"]].append(g.first["lr_mult"])
    metric, accuracy = rows[0]["metric"], rows[0]["accuracy"]
    lines = [
        f"| run | B (B0) | lr | seeds | optimizer steps | mean batch | {metric} | {accuracy} | B/B*, at cap | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def line(g: Group, label: str) -> str:
        return (
            f"| {label} | {g.first['batch']} | {g.first['lr']:.3g} | {len(g.rows)} | {g.mean('steps'):.0f}"
            f" | {g.mean('mean_batch'):.0f} | {g.mean('metric_value'):.4f} ± {g.std('metric_value'):.4f}"
            f" | {g.mean('accuracy_value'):.4f} ± {g.std('accuracy_value'):.4f}"
            f" | {_follow(g)} | {g.mean('wall_s'):.0f} |"
        )

    for g in sorted(
        groups, key=lambda g: (g.first["method"] != "static", g.first["batch"], g.first["lr_mult"], str(g.key))
    ):
        f = g.first
        if f["method"] == "static":
            mults = sorted(grid[f["batch"]])
            mark = ""
            if frontier[f["batch"]] is g:
                mark = " **best LR**"
                if len(mults) > 1 and f["lr_mult"] in (mults[0], mults[-1]):
                    mark += " (grid edge)"
            name = f"static x{f['lr_mult']:g}{mark}"
        else:
            name = label(f)
        lines.append(line(g, name))
    lines.append("")
    for g in groups:
        f = g.first
        if f["method"] == "static" or not frontier:
            continue
        v = verdict(frontier, g)
        reach = v["static_steps_for_its_metric"]
        lines.append(
            f"- {label(f)}:"
            f" {g.mean('metric_value'):.4f} in {g.mean('steps'):.0f} steps; best static B={v['best_static_batch']}"
            f" {v['best_static_metric']:.4f} in {v['best_static_steps']:.0f} steps;"
            f" {'reaches' if v['reaches_best'] else 'does not reach'} it within the seeds' spread;"
            + (
                " no static batch reaches its metric."
                if reach is None
                else f" static batches need {reach:.0f} steps for its metric (interpolated; measured"
                f" {v['static_steps_measured']:.0f}): {'above' if v['above_frontier'] else 'not above'} the frontier."
            )
        )
    return "\n".join(lines)


def _follow(g: Group) -> str:
    if g.first["method"] == "static":
        return ""
    ratios = [r["batch_over_bstar"] for r in g.rows if math.isfinite(r["batch_over_bstar"])]
    ratio = f"{statistics.median(ratios):.2f}" if ratios else "-"
    return f"{ratio}, {g.mean('at_cap'):.0%}"


def plot_task(rows: list[dict[str, Any]], task: str, path: Path) -> None:
    """Metric against optimizer steps (static frontier, SimiGrad and ramp points) and their batch-size traces."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(group_rows(r for r in rows if r["task"] == task).values())
    frontier = best_static(groups)
    fig, (ax, ax_trace) = plt.subplots(1, 2, figsize=(12, 4.8))
    for g in groups:
        if g.first["method"] == "static" and frontier.get(g.first["batch"]) is not g:
            ax.plot(g.mean("steps"), g.mean("metric_value"), "o", color="0.75", markersize=3)
    xs = [g.mean("steps") for g in frontier.values()]
    ax.errorbar(xs, [g.mean("metric_value") for g in frontier.values()],
                yerr=[g.std("metric_value") for g in frontier.values()],
                color="k", marker="s", capsize=3, label="static B, best LR")  # fmt: skip
    for x, (b, g) in zip(xs, frontier.items()):
        ax.annotate(f"B={b}", (x, g.mean("metric_value")), textcoords="offset points", xytext=(4, 4), fontsize=7)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    others = [g for g in groups if g.first["method"] != "static"]
    traced = False
    for i, g in enumerate(others):
        name = label(g.first).replace("tau", "τ")
        color = colors[i % len(colors)]
        ramp = g.first["method"].startswith("ramp")
        ax.errorbar(g.mean("steps"), g.mean("metric_value"), xerr=g.std("steps"), yerr=g.std("metric_value"),
                    marker="^" if ramp else "o", color=color, capsize=3, linestyle="none", label=name)  # fmt: skip
        for r in g.rows:
            trace = Path(r["run_dir"]) / "simigrad_trace.csv"
            if trace.is_file():
                with trace.open() as fh:
                    t = list(csv.DictReader(fh))
                samples, sizes = [float(x["samples_seen"]) for x in t], [float(x["batch_size"]) for x in t]
                first, traced = r is g.rows[0], True
                ax_trace.plot(samples, sizes, color=color, alpha=0.6, linewidth=0.8, label=name if first else None,
                              linestyle="--" if ramp else "-")  # fmt: skip
    # the frontier and SimiGrad set the range; a rate that diverged would squash them into one line
    shown = [(g.mean("metric_value"), g.std("metric_value")) for g in [*frontier.values(), *others]]
    if shown:
        low, high = min(m - s for m, s in shown), max(m + s for m, s in shown)
        ax.set_ylim(low - 0.1 * (high - low), high + 0.1 * (high - low))
    ax.set_xscale("log")
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel(f"final {rows[0]['metric']} (lower is better)")
    ax.set_title(f"{task}: {rows[0]['budget']} samples per run")
    ax.legend(fontsize=7)
    ax_trace.set_yscale("log")
    ax_trace.set_xlabel("samples seen")
    ax_trace.set_ylabel("batch size")
    ax_trace.set_title("batch size, SimiGrad and ramps (every seed)")
    if traced:
        ax_trace.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one seed, the sqrt-scaled LR only, the tasks' quick budgets")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; --quick: 0)")
    p.add_argument("--sizes", default=None, help="static batches, comma-separated (default: 6 powers of 2 from B0)")
    p.add_argument("--lr-grid", default=None, help="LR multipliers around lr0 sqrt(B/B0) (default 0.5,1,2; --quick: 1)")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every task's sample budget")
    p.add_argument("--extend", type=int, default=None,
                   help="times to widen the LR grid where a best rate is at its edge (2; quick 0)")  # fmt: skip
    p.add_argument("--variant", action="append", default=[], metavar="NAME:OVERRIDES",
                   help="an extra SimiGrad configuration: the paper rule at the first target, plus these")  # fmt: skip
    p.add_argument("--no-static", action="store_true", help="run no static batch (B0's LR: from the CSV, else x1)")
    p.add_argument("--no-simigrad", action="store_true", help="run only the static batches (and the ramps)")
    p.add_argument("--no-ramps", action="store_true", help="run no batch-size ramp")
    p.add_argument("--ramps", default=None, metavar="NAME,...",
                   help="run only these ramps, in this order (to64-over-quarter, to64-over-half, ..: linear;"
                   " to64, to256, to1024: doublings)")  # fmt: skip
    p.add_argument("--simigrad", default=None, metavar="NAME,...",
                   help="run only these SimiGrad configurations, in this order: a --variant's NAME, or"
                   " paper-tau0.3, noise_scale-tau0.3 (the method at its target)")  # fmt: skip
    p.add_argument("--override", action="append", default=[], metavar="[TASK:]KEY=VALUE",
                   help="a Hydra override for every run (of TASK only, with the prefix); a run's own settings"
                   " win over it: optimizer.lr=X moves the grid's centre lr0 to X, not each run's rate")  # fmt: skip
    p.add_argument("--schedule", choices=("none", "linear"), default="none", help="LR schedule over the budget")
    p.add_argument("--out", default="outputs/efficiency", help="results folder (resumed if it holds results.csv)")
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "results.csv"
    seeds = _ints(args.seeds) if args.seeds else ([0] if args.quick else [0, 1, 2])
    lr_grid = [float(x) for x in (args.lr_grid or ("1" if args.quick else "0.5,1,2")).split(",")]
    if args.extend is None:
        args.extend = 0 if args.quick else 2
    variants = [tuple(v.split(":", 1)) for v in args.variant]
    if any(len(v) != 2 for v in variants):
        sys.exit("--variant takes NAME:OVERRIDES, e.g. linear:simigrad.lr_scaling=linear")
    os.environ.setdefault("WANDB_MODE", "disabled")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):  # one line per run is enough
        logging.getLogger(name).setLevel(logging.WARNING)

    start = time.perf_counter()
    done = {r["run_id"] for r in read_rows(csv_path)}
    trained = 0
    for name in args.tasks.split(","):
        if name not in TASKS:
            sys.exit(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
        extra = [o.split(":", 1)[1] if ":" in o.split("=", 1)[0] else o for o in args.override
                 if ":" not in o.split("=", 1)[0] or o.split(":", 1)[0] == name]  # fmt: skip
        task = with_recipe_defaults(TASKS[name], extra)
        budget = round((task.quick_budget if args.quick else task.budget) * args.budget_scale)
        sizes = _ints(args.sizes) if args.sizes else [task.smallest_batch * 2**i for i in range(SIZES)]
        plan = [] if args.no_static else static_runs(task, name, sizes, lr_grid, seeds, budget)
        todo = [r for r in plan if r.run_id not in done]
        print(f"\n== {name}: {budget} samples per run; {len(plan)} static runs ({len(plan) - len(todo)} already done)")
        trained += _train_all(task, todo, out, extra, args.schedule, csv_path)
        for _ in range(0 if args.no_static else args.extend):
            todo = widen_grid(task, name, read_rows(csv_path), sizes, seeds, budget)
            if not todo:
                break
            print(f"== {name}: {len(todo)} static runs at rates past a grid edge or tried for other seeds")
            trained += _train_all(task, todo, out, extra, args.schedule, csv_path)
        # SimiGrad starts from B0 with B0's best learning rate among those tried
        b0_rows = [r for r in read_rows(csv_path) if r["task"] == name and r["method"] == "static"
                   and r["batch"] == task.smallest_batch and r["budget"] == budget]  # fmt: skip
        b0_best = best_static(group_rows(b0_rows).values()).get(task.smallest_batch)
        lr_mult = b0_best.first["lr_mult"] if b0_best else 1.0
        plan = [] if args.no_simigrad else simigrad_runs(task, name, lr_mult, seeds, budget, variants)  # type: ignore[arg-type]
        plan = select(plan, args.simigrad, "SimiGrad configuration")
        todo = [r for r in plan if r.run_id not in done]
        print(f"== {name}: {len(plan)} SimiGrad runs from B0={task.smallest_batch} at lr x{lr_mult:g}"
              f" ({len(plan) - len(todo)} already done)")  # fmt: skip
        trained += _train_all(task, todo, out, extra, args.schedule, csv_path)
        plan = [] if args.no_ramps else ramp_runs(task, name, lr_mult, seeds, budget, args.quick)
        plan = select(plan, args.ramps, "ramp")
        todo = [r for r in plan if r.run_id not in done]
        print(f"== {name}: {len(plan)} ramp runs from B0={task.smallest_batch} ({len(plan) - len(todo)} already done)")
        trained += _train_all(task, todo, out, extra, args.schedule, csv_path)

    rows = read_rows(csv_path)
    report = []
    for name in args.tasks.split(","):
        budget = round((TASKS[name].quick_budget if args.quick else TASKS[name].budget) * args.budget_scale)
        task_rows = [r for r in rows if r["task"] == name and r["budget"] == budget]
        if not task_rows:
            continue
        table = summary_table(task_rows, name)
        report.append(f"## {name} ({budget} samples per run)\n\n{table}\n")
        plot_task(task_rows, name, out / f"efficiency_{name}.png")
    text = "\n".join(report)
    (out / "summary.md").write_text(text)
    print("\n" + text)
    elapsed = time.perf_counter() - start
    print(
        f"{trained} runs trained in {elapsed / 60:.1f} min ({len(rows)} in {csv_path}); figures and summary.md in {out}"
    )
    return 0


def _train_all(task: Task, runs: list[Run], out: Path, extra: list[str], schedule: str, csv_path: Path) -> int:
    for i, run in enumerate(runs):
        row = run_one(task, run, out, extra, schedule)
        append_row(csv_path, row)
        print(
            f"[{i + 1}/{len(runs)}] {run.run_id}: {row['metric']} {row['metric_value']:.4f},"
            f" {row['steps']} steps, mean batch {row['mean_batch']:.0f}, {row['wall_s']:.0f} s",
            flush=True,
        )
    return len(runs)


if __name__ == "__main__":
    sys.exit(main())
