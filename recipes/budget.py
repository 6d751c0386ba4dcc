"""Stop a fit after a number of training samples: the budget of a comparison between batch sizes.

``max_steps`` counts optimizer steps, whose size SimiGrad changes, and ``max_epochs`` whole passes; a
study of batch sizes at equal cost needs the same number of samples for every run, whatever its
batch. ``train_samples=N`` (a top-level recipe key) adds :class:`SampleBudget`.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.optim import Optimizer
from typing_extensions import override

from recipes.trace import find_simigrad


class SampleBudget(Callback):
    """Ask the Trainer to stop after the optimizer step that brings the samples trained on to ``samples``.

    The stop falls on a step's end, so a run overshoots the budget by less than its last batch. Lightning
    then runs validation as for any early stop. Samples are SimiGrad's count when the callback is present
    (exact under DDP), else the micro-batches' lengths times the world size.

    Args:
        samples: the budget, in training samples (> 0).
    """

    def __init__(self, samples: int) -> None:
        if isinstance(samples, bool) or not isinstance(samples, int) or samples <= 0:
            raise ValueError(f"`train_samples` must be a positive int, got {samples!r}.")
        self.samples = samples
        self._counted = 0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._counted += _length(batch) * trainer.world_size

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        simigrad = find_simigrad(trainer)  # runs after SimiGrad's hook, which has counted this step
        seen = simigrad.samples_seen if simigrad is not None else self._counted
        if seen >= self.samples:
            trainer.should_stop = True


def _length(batch: Any) -> int:
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    if isinstance(batch, (list, tuple)):
        batch = batch[0]
    return len(batch)
