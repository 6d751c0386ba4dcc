r"""Lightning's step and batch counts, read in samples, so that settings written for a fixed batch keep their meaning.

A user writes an LR schedule, ``max_steps``, ``val_check_interval`` or ``limit_train_batches`` for the
batch their DataLoader and learning rate were set up with: :math:`B_0` samples a step, ``batch_size``
samples a batch on each of :math:`W` ranks. When SimiGrad makes steps of :math:`B` samples, those counts
are read in samples:

- a *B0-step* is :math:`B_0` samples. ``trainer.estimated_stepping_batches`` counts the fit in B0-steps:
  exactly the steps a run at the fixed batch :math:`B_0` takes. A step of :math:`B` samples advances
  step-interval LR schedules by :math:`B / B_0` of them (a scheduler's ``frequency`` counts them within
  each epoch, as Lightning counts its batches), and ``max_steps`` bounds the fit to ``max_steps``
  B0-steps of samples (with ``schedule_by_samples=True``, the default). A schedule built on the estimate
  so runs once over the whole fit and ends where the fixed-batch run's ends.
- ``limit_train_batches=k`` limits an epoch to the samples of ``k`` DataLoader batches, :math:`k b W` (a
  fraction, to that fraction of the epoch), and ``val_check_interval=k`` validates after every :math:`k b W`
  samples (a fraction: after that fraction of the epoch). The sampler plans the epoch's last window to end
  exactly at the limit.

An epoch counts ``ceil(samples / B0)`` B0-steps (``floor`` with ``drop_last``), as the fixed-:math:`B_0`
run steps. Within an epoch the count is ``floor(samples done / B0)``; at the epoch's end it is the epoch's
whole count, and at the end of the fit's sample budget the budget's. So the count never exceeds the
estimate and reaches it exactly at the end.

Pure arithmetic, no Lightning: :mod:`lightning_simigrad.integration.sample_schedules` applies it to Lightning's loops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Data", "FitBounds", "FitLength", "Limits", "epoch_limit", "validation_interval"]


def epoch_limit(samples: int, batch_size: int, world_size: int, limit_train_batches: int | float) -> int | None:
    """Samples an epoch feeds under ``limit_train_batches`` (None: all ``samples``).

    Args:
        samples: the epoch's samples without a limit.
        batch_size: the DataLoader's ``batch_size`` (per rank).
        world_size: number of ranks.
        limit_train_batches: Lightning's setting: an int number of batches or a fraction of the epoch.

    Raises:
        ValueError: for a fraction that leaves less than one sample.

    >>> epoch_limit(1000, 16, 2, 10), epoch_limit(1000, 16, 2, 0.25), epoch_limit(1000, 16, 2, 1.0)
    (320, 250, None)
    """
    if isinstance(limit_train_batches, int):
        return min(samples, limit_train_batches * batch_size * world_size)
    if limit_train_batches >= 1.0:
        return None
    limited = int(samples * limit_train_batches)
    if limited < 1:
        raise ValueError(
            f"`limit_train_batches={limit_train_batches}` of {samples} training samples is less than one sample."
            f" Raise it to at least {1 / samples:.3g}."
        )
    return limited


def validation_interval(
    epoch_samples: int,
    batch_size: int,
    world_size: int,
    val_check_interval: int | float | None,
    check_val_every_n_epoch: int | None,
) -> tuple[int, bool] | None:
    """``val_check_interval`` in samples, and whether it counts within each epoch (True) or over the fit.

    None: validate at each epoch's end, or, for ``val_check_interval=None`` (a time-based interval, which
    Lightning keeps apart), by Lightning's rule for times. Raises ``ValueError`` for an int interval longer
    than the epoch where Lightning counts it within the epoch (validation would never run; Lightning refuses
    it too).

    >>> validation_interval(1000, 16, 2, 10, 1), validation_interval(1000, 16, 2, 0.25, 1)
    ((320, True), (250, True))
    >>> validation_interval(1000, 16, 2, 100, None), validation_interval(1000, 16, 2, 1.0, 1)
    ((3200, False), None)
    """
    if val_check_interval is None:
        return None
    if isinstance(val_check_interval, float):
        return None if val_check_interval == 1.0 else (max(1, int(epoch_samples * val_check_interval)), True)
    if check_val_every_n_epoch is not None:
        batches = math.ceil(epoch_samples / (batch_size * world_size))
        if val_check_interval > batches:
            ranks = f" x {world_size} ranks" if world_size > 1 else ""
            raise ValueError(
                f"`val_check_interval` ({val_check_interval}) must be less than or equal to the number of training"
                f" batches ({batches}: {epoch_samples} samples per epoch in batches of {batch_size}{ranks});"
                " validation would never run. Lower it, set `check_val_every_n_epoch=None` to count batches over"
                " the whole fit, or set `limit_val_batches=0` to disable validation."
            )
    return val_check_interval * batch_size * world_size, check_val_every_n_epoch is not None


@dataclass(frozen=True)
class FitLength:
    """How much a fit trains, in samples, and the same counted in B0-steps.

    Args:
        initial_batch_size: :math:`B_0`.
        epoch_samples: samples an epoch feeds (the dataset, or what ``limit_train_batches`` leaves of it); None
            where the epoch's length is unknown (a stream): B0-steps are then counted over the fit, not per epoch.
        drop_last: the DataLoader drops a tail smaller than the batch.
        max_epochs: the epoch bound (``-1``: none).
        budget: most samples the fit trains (``math.inf``: none).
        epoch_weight: where batches are counted in tokens, an epoch's tokens; B0-steps are then counted over the fit
            (an epoch's positions are in samples, its B0-steps in tokens), and an epoch is ``epoch_weight / B0`` of
            them.

    >>> length = FitLength(initial_batch_size=16, epoch_samples=100, drop_last=False, max_epochs=3, budget=math.inf)
    >>> length.steps_per_epoch, length.stepping_batches
    (7, 21)
    >>> length.steps_done(epoch=1, epoch_samples_done=40, samples_seen=140, at_epoch_end=False)  # 7 + 40 // 16
    9
    >>> FitLength(16, 100, False, 3, budget=16 * 10).stepping_batches  # max_steps=10: ten B0-steps of samples
    10
    >>> unknown = FitLength(16, None, False, 3, budget=16 * 10)  # a stream: only the budget bounds the count
    >>> unknown.stepping_batches, unknown.steps_done(epoch=1, epoch_samples_done=8, samples_seen=40, at_epoch_end=False)
    (10, 2)
    >>> FitLength(1024, None, False, 3, math.inf, epoch_weight=100_000).stepping_batches  # tokens: 98 an epoch
    294
    """

    initial_batch_size: int
    epoch_samples: int | None
    drop_last: bool
    max_epochs: int
    budget: float
    epoch_weight: float | None = None

    @property
    def steps_per_epoch(self) -> int | None:
        """B0-steps in an epoch, counted per epoch (None: the epoch's length is unknown, or counted in tokens)."""
        if self.epoch_samples is None:
            return None
        return self._steps_in(self.epoch_samples)

    def _steps_in(self, epoch_weight: float) -> int:
        rounding = math.floor if self.drop_last else math.ceil
        return int(rounding(epoch_weight / self.initial_batch_size))

    @property
    def budget_steps(self) -> float:
        return math.ceil(self.budget / self.initial_batch_size) if math.isfinite(self.budget) else math.inf

    @property
    def stepping_batches(self) -> float:
        """The fit's length in B0-steps (``math.inf`` when nothing bounds it)."""
        per_epoch = self.steps_per_epoch
        if per_epoch is None and self.epoch_weight is not None:
            per_epoch = self._steps_in(self.epoch_weight)
        by_epochs = math.inf if self.max_epochs == -1 or per_epoch is None else per_epoch * max(self.max_epochs, 1)
        total = min(by_epochs, self.budget_steps)
        return total if math.isinf(total) else int(total)

    def step_in_window(self, epoch: int, epoch_samples_done: int, samples_seen: int, window: int) -> int:
        """The B0-step whose learning rate a step of ``window`` samples applies: the middle one it spans.

        A step over B0-steps ``p .. p + k - 1`` stands for ``k`` steps of the fixed batch, whose learning
        rates it should average: the schedule's value at ``p + (k - 1) / 2`` (rounded down). A step of
        exactly B0 samples uses ``p``, as the fixed-batch run does.

        >>> FitLength(8, 1000, False, 1, math.inf).step_in_window(0, epoch_samples_done=16, samples_seen=16, window=40)
        4
        """
        per_epoch = self.steps_per_epoch
        if per_epoch is None:  # counted over the fit
            twice = 2 * samples_seen + window - self.initial_batch_size
            return int(min(max(twice, 0) // (2 * self.initial_batch_size), self.stepping_batches))
        twice = 2 * epoch_samples_done + window - self.initial_batch_size
        within = min(per_epoch, max(twice, 0) // (2 * self.initial_batch_size))
        return int(min(epoch * per_epoch + within, self.stepping_batches))

    def scheduler_steps(self, steps_done: int, frequency: int) -> int:
        """Steps a step-interval scheduler of ``frequency`` has taken after ``steps_done`` B0-steps of the fit.

        Lightning counts ``frequency`` within each epoch (it steps at batches with ``(batch_idx + 1) % frequency
        == 0``), so each epoch contributes ``steps_per_epoch // frequency``, not a share of a count over the fit.

        >>> FitLength(8, 100, False, 3, math.inf).scheduler_steps(26, frequency=2)  # 13 B0-steps an epoch: 6 + 6
        12
        """
        per_epoch = self.steps_per_epoch
        if not per_epoch:  # unknown or empty epochs: counted over the fit
            return steps_done // frequency
        epochs, within = divmod(steps_done, per_epoch)
        return epochs * (per_epoch // frequency) + within // frequency

    def steps_done(self, epoch: int, epoch_samples_done: int, samples_seen: int, at_epoch_end: bool) -> int:
        """B0-steps of progress after ``samples_seen`` samples, ``epoch_samples_done`` of them in ``epoch``."""
        total = self.stepping_batches
        if samples_seen >= self.budget:
            return int(total)  # the fit's last step: the budget's whole count
        per_epoch = self.steps_per_epoch
        if per_epoch is None:
            return int(min(samples_seen // self.initial_batch_size, total))
        within = per_epoch if at_epoch_end else min(per_epoch, epoch_samples_done // self.initial_batch_size)
        return int(min(epoch * per_epoch + within, total))


@dataclass(frozen=True)
class Data:
    """The training data as a fit sees it.

    Args:
        epoch_length: samples in an epoch's order (None: unknown, a stream).
        batch_size: the DataLoader's ``batch_size`` (per rank).
        drop_last: the DataLoader drops a tail smaller than the batch.
        regenerable_order: the order can be drawn again (a resume can pick it up mid-epoch).
        sampler: the order's name, for messages.
        weights: where the unit weighs samples unalike (tokens), every sample's weight by dataset index (an int64
            tensor); None: every sample weighs 1.
        weight: their sum, the dataset's weight (None where every sample weighs 1).
    """

    epoch_length: int | None
    batch_size: int
    drop_last: bool
    regenerable_order: bool = True
    sampler: str = "SequentialSampler"
    weights: Any = field(default=None, compare=False, repr=False)
    weight: int | None = None


@dataclass(frozen=True)
class Limits:
    """The Trainer's settings that bound a fit, as the user gave them (Lightning's names and meanings)."""

    limit_train_batches: int | float = 1.0
    max_steps: int = -1
    max_epochs: int = -1
    val_check_interval: int | float | None = 1.0
    check_val_every_n_epoch: int | None = 1
    validates: bool = True


@dataclass(frozen=True)
class FitBounds:
    """Where a fit's settings bound it, read in samples (or weight): the epoch's samples, the population the halves
    are drawn from, the fit's budget, its length in B0-steps and its validation interval.

    Args:
        data: the training data.
        limits: the Trainer's bounds.
        world_size: data-parallel ranks.
        initial_batch_size: B0.
        max_samples: the fit's own bound (``SimiGrad(max_samples=...)``).
        schedule_by_samples: ``max_steps`` counts B0-steps of samples.

    >>> bounds = FitBounds(Data(1000, 16, False), Limits(max_steps=10), 2, 64, None, True)
    >>> bounds.epoch_samples(), bounds.budget(), bounds.population()
    (1000, 640.0, 1000.0)
    >>> FitBounds(Data(None, 16, False), Limits(), 2, 64, None, True).population()  # a stream: independent draws
    inf
    """

    data: Data
    limits: Limits
    world_size: int
    initial_batch_size: int
    max_samples: int | None
    schedule_by_samples: bool

    def epoch_samples(self) -> int | None:
        """Samples an epoch feeds: the epoch's order, or what ``limit_train_batches`` leaves of it (None: unknown)."""
        length = self.data.epoch_length
        if length is None:
            return None
        limit = epoch_limit(length, self.data.batch_size, self.world_size, self.limits.limit_train_batches)
        return length if limit is None else limit

    def population(self) -> float:
        """The :math:`N` samples every window is drawn from without replacement: the whole epoch's order on all ranks
        (``limit_train_batches`` takes its first part, still a uniform draw from all of it); ``math.inf`` for an order
        that cannot be regenerated (a sampler with replacement, weighted, or the user's own) or of unknown length,
        read as independent draws."""
        length = self.data.epoch_length
        return float(length) if self.data.regenerable_order and length is not None and length > 1 else math.inf

    def budget(self) -> float:
        """The weight the whole fit may train: ``max_samples``, and ``max_steps`` counted in B0-steps."""
        budget = float(self.max_samples) if self.max_samples is not None else math.inf
        if self.schedule_by_samples and self.limits.max_steps != -1:
            budget = min(budget, float(self.limits.max_steps * self.initial_batch_size))
        return budget

    def fit_length(self) -> FitLength:
        epoch_samples, weight, length = self.epoch_samples(), self.data.weight, self.data.epoch_length
        if weight is not None and epoch_samples is not None and length:  # counted in tokens: over the fit
            return FitLength(
                self.initial_batch_size,
                None,
                self.data.drop_last,
                self.limits.max_epochs,
                self.budget(),
                epoch_weight=weight * epoch_samples / length,  # what a limited epoch's share holds, on average
            )
        return FitLength(
            self.initial_batch_size, epoch_samples, self.data.drop_last, self.limits.max_epochs, self.budget()
        )

    def validation_interval(self) -> tuple[int, bool] | None:
        """The validation interval in samples and whether it counts within the epoch; None: at epochs' ends."""
        if not self.limits.validates:
            return None
        epoch_samples = self.epoch_samples()
        if epoch_samples is None:
            interval = self.limits.val_check_interval
            if isinstance(interval, int) and not isinstance(interval, bool):
                return (
                    interval * self.data.batch_size * self.world_size,
                    self.limits.check_val_every_n_epoch is not None,
                )
            return None  # a fraction of an epoch of unknown length: at its end
        return validation_interval(
            epoch_samples,
            self.data.batch_size,
            self.world_size,
            self.limits.val_check_interval,
            self.limits.check_val_every_n_epoch,
        )
