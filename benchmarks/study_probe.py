"""A logger that times a run's training apart from its validations: ``benchmarks/study.py`` reads steps, samples,
tokens and CPU and wall seconds at every validation from it.

The recipes build their own callbacks, but instantiate whatever logger the config names, so the study sets
``logger._target_=study_probe.Probe`` (``benchmarks/`` on ``sys.path``). SimiGrad and the fixed schedules log
``simigrad/*`` once per optimizer step and the model logs ``val/*`` once per validation, through every logger:

- each optimizer step's row stamps the process's CPU time and the wall clock;
- each validation's row is stamped when its metrics arrive; the time since the step before it is validation,
  subtracted from the run's training time from then on.

So at each validation ``curve.csv`` (in the run folder) holds the optimizer steps, samples (and tokens) trained,
the training seconds spent (CPU of this process and wall, validations excluded) and the validation metrics. The
optimizer step that precedes a validation is timed with it (a few milliseconds on these models).
"""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger

CURVE_COLUMNS = ["validation", "steps", "samples", "tokens", "train_cpu_s", "train_wall_s", "val_cpu_s", "val_wall_s"]


class Probe(CSVLogger):
    """Lightning's CSV logger (``metrics.csv`` as ``logger=csv`` writes it), plus ``curve.csv``."""

    def __init__(self, save_dir: str, name: str = "logs", **kwargs: Any) -> None:
        super().__init__(save_dir, name=name, **kwargs)
        self.curve_path = Path(save_dir) / "curve.csv"
        self.curve: list[dict[str, float]] = []
        self.steps = 0
        self.samples = self.tokens = 0.0
        self.start = (time.process_time(), time.perf_counter())
        self.last_step = self.start  # when the last optimizer step was logged
        self.validating = (0.0, 0.0)  # CPU and wall seconds spent validating so far

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        now = (time.process_time(), time.perf_counter())
        if "simigrad/samples_seen" in metrics:
            self.steps += 1
            self.samples = float(metrics["simigrad/samples_seen"])
            self.tokens = float(metrics.get("simigrad/tokens_seen", self.samples))
            self.last_step = now
        values = {k: float(v) for k, v in metrics.items() if k.startswith("val/")}
        if values:
            spent = (now[0] - self.last_step[0], now[1] - self.last_step[1])
            self.validating = (self.validating[0] + spent[0], self.validating[1] + spent[1])
            self.curve.append(
                {
                    "validation": len(self.curve) + 1,
                    "steps": self.steps,
                    "samples": self.samples,
                    "tokens": self.tokens,
                    "train_cpu_s": self.last_step[0] - self.start[0] - (self.validating[0] - spent[0]),
                    "train_wall_s": self.last_step[1] - self.start[1] - (self.validating[1] - spent[1]),
                    "val_cpu_s": spent[0],
                    "val_wall_s": spent[1],
                    **values,
                }
            )
            self.last_step = now  # the next step's time starts after this validation
        super().log_metrics(metrics, step)

    def finalize(self, status: str) -> None:
        super().finalize(status)
        if not self.curve:
            return
        keys = CURVE_COLUMNS + sorted({k for row in self.curve for k in row} - set(CURVE_COLUMNS))
        with self.curve_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(self.curve)
