"""Lightning's own training progress bars, kept readable while the batch size changes.

An epoch's number of micro-batches depends on batch sizes not chosen yet, so Lightning sees the
training DataLoader as having no length: without help its bars count micro-batches with no total and
no time remaining. :class:`EpochProgress` gives them one notion of progress, the same as
``batch_idx``: micro-batches, with the epoch's total re-estimated every micro-batch from the windows
the sampler has planned (exact) and the samples left (at the current micro-batch size). It lands on
the exact count when the sampler has planned the epoch's last window, so the final count equals the
total and the time remaining converges as the batch size settles.

The estimate is ``trainer.num_training_batches`` (so the bars, and any callback that reads it, agree),
and it is pushed into the bar already shown: ``TQDMProgressBar``'s ``train_progress_bar.total`` or
``RichProgressBar``'s task. Until the epoch's real end it stays above the micro-batches already
fetched, so Lightning never takes it for the end of the epoch. The postfix gains SimiGrad's numbers,
formatted to a fixed width so the bar does not jitter: the global batch of the current step, the last
measured similarity and the noise scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from lightning_simigrad.data.schedule import EpochPlan

__all__ = ["EpochProgress", "postfix_fields"]


class _Padded(str):
    """A string tqdm's ``set_postfix`` does not strip (it strips every value): the padding keeps its width."""

    def strip(self, chars: str | None = None) -> str:
        return str(self)


def postfix_fields(batch_size: int, width: int, similarity: float, noise_scale: float) -> dict[str, str]:
    """SimiGrad's postfix, each value right-aligned in a width that does not change during the fit.

    >>> postfix_fields(96, 4, 0.4567, 1234.5)
    {'batch': '  96', 'sim': ' 0.46', 'B_noise': '1.23e+03'}
    >>> postfix_fields(1024, 4, math.nan, math.nan)
    {'batch': '1024', 'sim': '    -', 'B_noise': '       -'}
    """
    fields = {
        "batch": f"{batch_size:>{width}d}",
        "sim": f"{similarity:>5.2f}" if math.isfinite(similarity) else f"{'-':>5}",
        "B_noise": f"{noise_scale:>8.3g}" if math.isfinite(noise_scale) else f"{'-':>8}",
    }
    return {key: _Padded(value) for key, value in fields.items()}


class EpochProgress:
    """Re-estimates the epoch's micro-batch total for Lightning and its progress bar; adds SimiGrad's postfix.

    Args:
        fields: returns the postfix entries to add (see :func:`postfix_fields`), or None to add nothing.
    """

    def __init__(self, fields: Callable[[], dict[str, str] | None]) -> None:
        self._fields = fields
        self._bar: pl.Callback | None = None

    def attach(self, trainer: pl.Trainer) -> None:
        bar = trainer.progress_bar_callback
        if not isinstance(bar, (TQDMProgressBar, RichProgressBar)) or "get_metrics" in bar.__dict__:
            return
        get_metrics = bar.get_metrics

        def get_metrics_with_simigrad(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
            items = get_metrics(trainer, pl_module)
            fields = self._fields() if trainer.training else None
            return {**items, **fields} if fields else items

        bar.get_metrics = get_metrics_with_simigrad  # type: ignore[method-assign]
        self._bar = bar

    def detach(self) -> None:
        if self._bar is not None:
            self._bar.__dict__.pop("get_metrics", None)
            self._bar = None

    def start_epoch(self, trainer: pl.Trainer, micro_batches: int) -> None:
        """Before the bars read the epoch's total (they start after SimiGrad): a first estimate.

        Rich makes a bar whose first total is infinite an "infinite task" that never shows a time remaining,
        so the total must be finite from the start. A resumed epoch counts the micro-batches done before.
        """
        epoch_loop = trainer.fit_loop.epoch_loop
        done = epoch_loop.batch_progress.current.completed if epoch_loop.restarting else 0
        trainer.fit_loop.max_batches = done + max(1, micro_batches)

    def update(self, trainer: pl.Trainer, plan: EpochPlan) -> None:
        """After the sampler has placed the micro-batch being started in ``plan``: the epoch's total, for all."""
        # the epoch's micro-batches after this one (estimated where not yet planned), and whether this is the
        # epoch's last micro-batch (the data's end, not a stop)
        micro_batches_left, exact = plan.micro_batches_left()
        epoch_ends_here = exact and micro_batches_left == 0 and plan.ends_epoch
        ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # this micro-batch included
        total = ready + micro_batches_left
        # above what was fetched until the real end: Lightning ends an epoch when the two are equal
        trainer.fit_loop.max_batches = total if epoch_ends_here else max(total, ready + 1)
        bar = trainer.progress_bar_callback
        if isinstance(bar, TQDMProgressBar) and bar._train_progress_bar is not None:
            bar.train_progress_bar.total = trainer.fit_loop.max_batches
        elif isinstance(bar, RichProgressBar) and bar.progress is not None and bar.train_progress_bar_id is not None:
            # the task's field, not `progress.update(total=...)`, which would restart its speed estimate
            bar.train_progress_bar.total = trainer.fit_loop.max_batches
