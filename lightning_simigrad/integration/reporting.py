"""What SimiGrad tells the user: every step's metrics, the history, the fit's summary and the progress bar's postfix.

Every optimizer step makes one row of :data:`METRICS`. Rank zero sends it to every logger of the Trainer (with
the optimizer step's number as the step); every rank puts it in ``trainer.callback_metrics`` as tensors, so
Lightning's own callbacks can monitor it (``EarlyStopping(monitor="simigrad/batch_size")``,
``ModelCheckpoint(monitor="simigrad/similarity")``); the latest ``history_size`` rows stay in
:attr:`Reporting.history`. At the fit's end rank zero logs a one-line summary, and a W&B run gets it in its
summary table.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_simigrad.integration.progress_bar import postfix_fields
from lightning_simigrad.run import Run, Step

__all__ = ["METRICS", "METRIC_UNITS", "Reporting"]

# What every logged number counts, where batch sizes count samples and where they count tokens (`lengths`): a unit,
# "-" for a number without one, None where it is not logged. `loss_items` changes how a step weighs its samples, not
# what these count. The README's and docs/usage.md's tables are read against it (tests/test_docs.py).
METRIC_UNITS: dict[str, tuple[str | None, str | None]] = {
    "simigrad/batch_size": ("samples", "tokens"),
    "simigrad/similarity": ("-", "-"),
    "simigrad/lr_scale": ("-", "-"),
    "simigrad/lr": ("-", "-"),
    "simigrad/micro_batch_size": ("samples", "samples"),
    "simigrad/accumulation": ("micro-batches", "micro-batches"),
    "simigrad/samples_seen": ("samples", "samples"),
    "simigrad/noise_scale": ("samples", "samples"),
    "simigrad/batch_samples": (None, "samples"),
    "simigrad/tokens_seen": (None, "tokens"),
    "simigrad/noise_scale_tokens": (None, "tokens"),
}
METRICS = tuple(name for name, (samples, _) in METRIC_UNITS.items() if samples is not None)  # logged in every mode


class Reporting:
    """The metrics of every step, and the readings built from them.

    Args:
        history_size: how many of the latest steps :attr:`history` keeps (None: all, 0: none).
    """

    def __init__(self, history_size: int | None) -> None:
        self.history_size = history_size
        # one row per step, the latest `history_size` of them: a long fit's memory stays flat
        self.history: list[dict[str, float]] = []
        self.last_similarity = math.nan  # the last finite one, for the progress bar
        self.batch_range = (2**63, 0)  # smallest and largest step of this process's fits
        self.b0_steps = 0  # the samples trained so far, in steps of B0 (what the fixed batch takes)

    def annotate(self, **values: float) -> None:
        """Readings beside the step's row that only some fits have (``world_size_wanted``), into its history row."""
        if self.history_size != 0 and self.history:
            self.history[-1].update(values)

    def record(self, step: Step, run: Run, applied_lr: float, b0_steps: int) -> dict[str, float]:
        """The step's row of :data:`METRICS`, kept in the history."""
        row = {
            "simigrad/batch_size": float(step.weight),
            "simigrad/similarity": step.stats.similarity if step.stats is not None else math.nan,
            "simigrad/lr_scale": step.lr_factor,
            "simigrad/lr": applied_lr,
            "simigrad/micro_batch_size": float(step.window.max_micro_batch_size),
            "simigrad/accumulation": float(step.micro_batches),
            "simigrad/samples_seen": float(step.total_span[1]),
            "simigrad/noise_scale": run.controller.noise_scale,
        }
        unit = run.settings.batch_unit
        if unit.weighted:  # the batch counts a weight (tokens): its samples beside it, and the fit's weight
            row["simigrad/batch_samples"] = float(step.samples)
            row[f"simigrad/{unit.name}_seen"] = float(run.counts.weight_seen)
            # the noise scale counts samples (the halves' statistics do); in the batch's unit, at the step's weight
            # per sample (docs/measurement.md, "In tokens")
            per_sample = step.weight / step.samples if step.samples else math.nan
            row[f"simigrad/noise_scale_{unit.name}"] = run.controller.noise_scale * per_sample
        if self.history_size != 0:
            self.history.append({"step": float(step.index), **{k.split("/", 1)[1]: v for k, v in row.items()}})
            if self.history_size is not None and len(self.history) > self.history_size:
                del self.history[: len(self.history) - self.history_size]
        if math.isfinite(row["simigrad/similarity"]):
            self.last_similarity = row["simigrad/similarity"]
        if step.weight:
            low, high = self.batch_range
            self.batch_range = (min(low, step.weight), max(high, step.weight))
        self.b0_steps = b0_steps
        return row

    @staticmethod
    def publish(trainer: pl.Trainer, row: dict[str, float], step: int) -> None:
        """To the loggers (rank zero) and to ``trainer.callback_metrics`` (every rank, as Lightning keeps it)."""
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(row, step=step)
        trainer.callback_metrics.update({name: torch.tensor(value) for name, value in row.items()})

    def summary(self, run: Run) -> dict[str, int]:
        """The fit so far in numbers: optimizer steps, samples, batch-size range, and the steps B0 would take."""
        low, high = self.batch_range
        unit = run.settings.batch_unit
        weight = {unit.name: run.counts.weight_seen} if unit.weighted else {}
        return {
            "optimizer_steps": run.counts.steps,
            "samples": run.counts.samples_seen,
            **weight,
            "initial_batch_size": run.b0,
            "min_batch_size": low if high else 0,
            "max_batch_size": high,
            "steps_at_initial_batch_size": self.b0_steps,
        }

    def announce(self, trainer: pl.Trainer, numbers: dict[str, int], unit: str = "samples") -> None:
        """The summary, logged once on rank zero and put in a W&B run's summary table; batch sizes count ``unit``."""
        ratio = numbers["steps_at_initial_batch_size"] / max(1, numbers["optimizer_steps"])
        over = f"{numbers['samples']} samples"
        if unit in numbers and unit != "samples":  # batch sizes count a weight of each sample's
            over = f"{numbers[unit]} {unit} ({numbers['samples']} samples), batch size in {unit}"
        else:
            over += ", batch size"
        rank_zero_info(
            f"SimiGrad: {numbers['optimizer_steps']} optimizer steps over {over}"
            f" {numbers['min_batch_size']}..{numbers['max_batch_size']} (B0 = {numbers['initial_batch_size']});"
            f" a fixed batch of {numbers['initial_batch_size']} takes {numbers['steps_at_initial_batch_size']}"
            f" steps ({ratio:.1f}x as many)"
        )
        for logger in trainer.loggers:
            experiment: Any = getattr(logger, "experiment", None)
            if hasattr(experiment, "summary") and hasattr(experiment.summary, "update"):  # a W&B run's table
                experiment.summary.update({f"simigrad/{k}": v for k, v in numbers.items()})
            else:
                summary = {f"simigrad/summary/{k}": float(v) for k, v in numbers.items()}
                logger.log_metrics(summary, step=numbers["optimizer_steps"])

    def postfix(self, run: Run) -> dict[str, str] | None:
        """The progress bar's entries: this step's batch, the last similarity measured, the noise scale."""
        if run.window is None:
            return None
        widest = max(run.controller.max_batch_size or 0, run.bounds.epoch_samples() or 0, run.window.weight)
        return postfix_fields(run.window.weight, len(str(widest)), self.last_similarity, run.controller.noise_scale)
