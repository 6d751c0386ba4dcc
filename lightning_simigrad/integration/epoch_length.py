"""The epoch's length as Lightning reads it: an estimate in micro-batches, refined every micro-batch.

An epoch's number of micro-batches depends on batch sizes not chosen yet, so the training DataLoader has no
length. Lightning ends an epoch where its fetched micro-batches reach ``trainer.fit_loop.max_batches``, shows that
total in its progress bars, and gives it to callbacks as ``trainer.num_training_batches``. :class:`EpochLength`
keeps it: exact for the windows the data path has planned, the samples left counted at the current micro-batch
size, landing on the exact count once the epoch's last window is planned. Until the epoch's real end it stays
above the micro-batches already fetched, so Lightning never takes it for the end of the epoch. The bars already
shown get the new total too, so their time remaining converges as the batch size settles.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from lightning_simigrad.data.schedule import EpochPlan
from lightning_simigrad.run import Run

__all__ = ["EpochLength"]


class EpochLength:
    """Sets ``trainer.fit_loop.max_batches`` (the epoch's micro-batches as Lightning counts them) from the plan."""

    def start_epoch(self, trainer: pl.Trainer, run: Run) -> None:
        """Before the bars read the epoch's total (they start after SimiGrad): a first estimate, every window planned
        at the batch size asked for now.

        Rich makes a bar whose first total is infinite an "infinite task" that never shows a time remaining,
        so the total must be finite from the start. A resumed epoch counts the micro-batches done before.
        """
        epoch_samples, schedule = run.bounds.epoch_samples(), run.schedule
        window = schedule.typical_window(schedule.batch_size)  # the batch asked for, in what batch sizes count
        if epoch_samples is None:  # an epoch of unknown length: one window's micro-batches at a time
            micro_batches = window.num_micro_batches
        else:
            # the epoch's samples left, and the fit's budget (in the batch's unit) read in samples
            per_sample = window.weight / window.total
            samples = min(epoch_samples - run.counts.epoch_samples_done, max(run.weight_left() / per_sample, 1))
            micro_batches = math.ceil(samples * window.num_micro_batches / window.total)
        epoch_loop = trainer.fit_loop.epoch_loop
        done = epoch_loop.batch_progress.current.completed if epoch_loop.restarting else 0
        trainer.fit_loop.max_batches = done + max(1, micro_batches)

    def update(self, trainer: pl.Trainer, plan: EpochPlan) -> None:
        """After the data path has placed the micro-batch being started in ``plan``: the epoch's total, for all."""
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
