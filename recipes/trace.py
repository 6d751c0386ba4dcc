"""Write the SimiGrad callback's per-step history as CSV + PNG, and send it to W&B.

The ``SimiGrad`` callback logs ``simigrad/*`` every optimizer step through the Trainer's loggers;
this callback adds what a logger alone does not give: W&B charts of ``simigrad/*`` against
``simigrad/samples_seen`` (not against the step, whose length varies), the resolved run config,
and, at the end of fit, one figure of batch size, similarity and LR scale against samples, written
into the run directory whatever the logger and logged to W&B as an image.

``docs/trace_digits.png`` is this figure for the digits default: ``simigrad-train logger=none
output_dir=outputs/trace``, then ``outputs/trace/simigrad_trace.png`` copied there.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lightning_simigrad import SimiGrad, equilibrium_batch_size

COLUMNS = [
    "step", "samples_seen", "batch_size", "micro_batch_size", "accumulation",
    "similarity", "lr_scale", "noise_scale",
]  # fmt: skip


def find_simigrad(trainer: pl.Trainer) -> SimiGrad | None:
    """The ``SimiGrad`` callback among the Trainer's callbacks (``None`` if absent)."""
    return next((cb for cb in trainer.callbacks if isinstance(cb, SimiGrad)), None)  # type: ignore[attr-defined]


def write_csv(history: list[dict[str, float]], path: Path) -> None:
    keys = [k for k in COLUMNS if any(k in row for row in history)]
    keys += sorted({k for row in history for k in row} - set(keys))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(history)


def plot(
    history: list[dict[str, float]], path: Path, title: str, target: float | None, population: float = math.inf
) -> None:
    """Three stacked panels against samples seen: batch size (and B_noise, and B* for the epoch's ``population``),
    similarity, LR scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [row.get("samples_seen", row.get("step", i)) for i, row in enumerate(history)]

    def col(key: str) -> list[float]:
        return [float(row.get(key, math.nan)) for row in history]

    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    axes[0].plot(x, col("batch_size"), label="batch size B")
    if any(math.isfinite(v) and v > 0 for v in col("noise_scale")):
        axes[0].plot(x, col("noise_scale"), alpha=0.6, label="noise scale $B_{noise}$")
        if target is not None and 0 < target < 1:  # the batch the target asks for
            b_star = [
                equilibrium_batch_size(v, target, population) if math.isfinite(v) else math.nan
                for v in col("noise_scale")
            ]
            axes[0].plot(x, b_star, "k--", linewidth=0.8, alpha=0.7, label=f"$B^*$ at target {target:g}")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("samples")
    axes[0].legend(loc="best", fontsize=8)
    axes[1].plot(x, col("similarity"), ".", markersize=2, label="cos(g_A, g_B)")
    if target is not None:
        axes[1].axhline(target, color="k", linestyle="--", linewidth=1, label=f"target {target:g}")
    axes[1].set_ylabel("similarity")
    axes[1].legend(loc="best", fontsize=8)
    axes[2].plot(x, col("lr_scale"))
    axes[2].set_ylabel("LR scale")
    axes[2].set_xlabel("samples seen")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class SimiGradTrace(Callback):
    """Trace of the SimiGrad callback: W&B metric axes and config at setup, CSV/PNG/image at fit end.

    Args:
        output_dir: where ``simigrad_trace.csv`` and ``simigrad_trace.png`` are written.
        run_config: the resolved Hydra config, sent to every logger's hyperparameters.
        title: figure title.
    """

    def __init__(self, output_dir: str | Path, run_config: dict[str, Any] | None = None, title: str = "") -> None:
        self.output_dir = Path(output_dir)
        self.run_config = run_config or {}
        self.title = title
        self.csv_path = self.output_dir / "simigrad_trace.csv"
        self.png_path = self.output_dir / "simigrad_trace.png"
        self.history: list[dict[str, float]] = []
        self.next_batch_size: int | None = None
        self.fit_summary: dict[str, int] = {}  # the callback's own summary: B0, and the tokens where batches count them

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        for logger in trainer.loggers:
            if self.run_config:
                logger.log_hyperparams(self.run_config)
            if isinstance(logger, WandbLogger) and trainer.is_global_zero:
                run = logger.experiment
                run.define_metric("simigrad/samples_seen")
                run.define_metric("simigrad/*", step_metric="simigrad/samples_seen")

    @override
    @rank_zero_only
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        simigrad = find_simigrad(trainer)
        self.history = [dict(row) for row in getattr(simigrad, "history", [])]
        self.next_batch_size = simigrad.batch_size if simigrad is not None else None
        self.fit_summary = simigrad.summary() if simigrad is not None else {}
        if not self.history:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_csv(self.history, self.csv_path)
        run = getattr(simigrad, "run", None)
        population = run.bounds.population() if run is not None else math.inf  # the epoch's N (inf: unknown)
        plot(self.history, self.png_path, self.title, getattr(simigrad, "target_similarity", None), population)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                import wandb

                logger.experiment.log({"simigrad/trace": wandb.Image(str(self.png_path))})

    def summary(self) -> dict[str, Any]:
        """Paths and the batch-size range the run moved through (empty if there is no history)."""
        if not self.history:
            return {}
        sizes = [int(row["batch_size"]) for row in self.history if "batch_size" in row]
        tokens = "tokens_seen" in self.history[-1]  # batch sizes count tokens (`lengths`)
        summary = {
            "trace_csv": str(self.csv_path),
            "trace_png": str(self.png_path),
            "steps": len(self.history),
            "unit": "tokens" if tokens else "samples",  # what every batch size here counts
            # B0, the batch the learning rate belongs to (the first step's window may differ: whole sequences)
            "initial_batch_size": int(self.fit_summary.get("initial_batch_size", sizes[0])),
            "first_step_batch_size": sizes[0],
            # the batch the callback would plan next, not trained (the last step may be an epoch's smaller tail)
            "final_batch_size": self.next_batch_size if self.next_batch_size is not None else sizes[-1],
            "last_step_batch_size": sizes[-1],
            "min_batch_size": min(sizes),
            "max_batch_size": max(sizes),
            "samples_seen": int(self.history[-1].get("samples_seen", 0)),
        }
        if tokens:
            summary["tokens_seen"] = int(self.history[-1]["tokens_seen"])
        return summary
