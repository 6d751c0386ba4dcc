r"""One fit of SimiGrad, without Lightning: the life of every optimizer step, from plan to commit.

A :class:`Run` is made when the training data arrives (the callback's
:mod:`~lightning_simigrad.integration.data_source` makes it) and owns everything a step needs: the controller,
the window schedule the sampler plans from, the measurement, and the fit's counts. One optimizer step reads,
top to bottom:

1. **plan** -- the sampler has already planned the step's window from the controller's batch size
   (:class:`~lightning_simigrad.data.schedule.WindowSchedule`): its micro-batches, their sizes on every rank;
2. **each micro-batch** -- :meth:`Run.start_micro_batch` says which window and slot it is, the loss divisor that
   weighs each of its samples by exactly ``1/N`` and the step's learning-rate factor; the measurement is told
   (on one process it sets the first half aside at the window's midpoint); after the backward,
   :meth:`Run.after_backward` counts the samples each half fed;
3. **halves and collect** -- :meth:`Run.finish_step` collects the two halves' statistics (with the loss scale
   taken out) while the gradients stay exactly those of plain training;
4. **decide** -- the controller turns the statistics into the next batch size;
5. **commit** -- the counts move on by what the step fed, and the step's record goes to the reporting.

A window the training loop abandons (an epoch or the fit ended inside it) is dropped by
:meth:`Run.end_epoch` / :meth:`Run.close`: nothing of it leaks into the next step.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_simigrad import _compat
from lightning_simigrad.core.controller import BatchSizeController
from lightning_simigrad.core.lr_scaling import lr_factor
from lightning_simigrad.core.plan import Window
from lightning_simigrad.core.sample_counts import FitLength, epoch_limit, validation_interval
from lightning_simigrad.core.settings import Settings
from lightning_simigrad.core.statistics import HalfStats
from lightning_simigrad.data.schedule import WindowSchedule
from lightning_simigrad.measurement.protocol import LossScale, Measurement
from lightning_simigrad.state.checkpoint import FORMAT_VERSION
from lightning_simigrad.state.resume import Restart, Resumption, Stage, resume
from lightning_simigrad.state.rng import rng_state

__all__ = ["Data", "Limits", "MicroBatch", "Run", "Step"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Data:
    """The training data as a run sees it.

    Args:
        epoch_length: samples in an epoch's order.
        batch_size: the DataLoader's ``batch_size`` (per rank).
        drop_last: the DataLoader drops a tail smaller than the batch.
        regenerable_order: the sampler's order can be drawn again (a resume can pick it up mid-epoch).
        sampler: the sampler's name, for messages.
    """

    epoch_length: int
    batch_size: int
    drop_last: bool
    regenerable_order: bool = True
    sampler: str = "SequentialSampler"


@dataclass(frozen=True)
class Limits:
    """The Trainer's settings that bound a fit, as the user gave them (Lightning's names and meanings)."""

    limit_train_batches: int | float = 1.0
    max_steps: int = -1
    max_epochs: int = -1
    val_check_interval: int | float = 1.0
    check_val_every_n_epoch: int | None = 1
    validates: bool = True


@dataclass(frozen=True)
class MicroBatch:
    """The micro-batch about to run: its window and slot, and how Lightning must treat it."""

    window: Window
    index: int
    local_samples: int  # this rank's samples (0: a zero-weight padding sample)
    loss_divisor: float  # N / (W n): each sample of the window weighs exactly 1 / N
    lr_factor: float
    reduces: bool = False  # its backward reduces the gradient across ranks though the window goes on

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.window.num_micro_batches - 1


@dataclass(frozen=True)
class Step:
    """What an optimizer step did."""

    index: int  # the step's number in the fit, from 0
    samples: int  # samples it averaged (fewer than the window's when micro-batches were skipped)
    stats: HalfStats | None  # the two halves' statistics (None: nothing measured)
    window: Window
    micro_batches: int
    lr_factor: float
    epoch_span: tuple[int, int]  # the epoch's position before and after (whole windows, skipped micro-batches too)
    total_span: tuple[int, int]  # samples seen before and after

    @property
    def skipped_micro_batches(self) -> bool:
        return 0 < self.samples < self.window.total


class Run:
    """The state and the step protocol of one fit (see the module docstring).

    Args:
        settings: the callback's settings.
        data: the training data.
        limits: the Trainer's bounds.
        world_size, rank: the data-parallel group and this rank in it.
        seed: the shuffling seed, agreed on by every rank.
        initial_batch_size: B0.
        epoch: returns the epoch being trained.
        measurement: measures each window's halves.
        restart: the checkpoint the fit resumes from, or None.
        warn, info: where the run's messages go (Lightning's integration passes its rank-zero warning and log).
    """

    def __init__(
        self,
        settings: Settings,
        data: Data,
        limits: Limits,
        world_size: int,
        rank: int,
        seed: int,
        initial_batch_size: int,
        epoch: Callable[[], int],
        measurement: Measurement,
        restart: Restart | None = None,
        warn: Callable[[str], None] = warnings.warn,
        info: Callable[[str], None] = _log.info,
    ) -> None:
        self.settings, self.data, self.limits = settings, data, limits
        self.world_size, self.rank, self.b0 = world_size, rank, initial_batch_size
        self.epoch = epoch
        self.measurement = measurement
        min_micro_batches = measurement.min_micro_batches  # two halves: in time, or two groups of ranks
        args = settings.controller_args(initial_batch_size, min_batch_size=world_size * min_micro_batches)
        if args["max_batch_size"] is not None and args["max_batch_size"] < args["min_batch_size"]:
            raise ValueError(
                f"`max_batch_size` ({args['max_batch_size']}) is below the {args['min_batch_size']} samples a"
                f" measurement needs with {world_size} rank(s). Raise it."
            )
        self.controller = BatchSizeController(**args)
        self.schedule = WindowSchedule(
            batch_size=self.controller.batch_size,
            max_micro_batch_size=settings.max_micro_batch_size or data.batch_size,
            world_size=world_size,
            min_micro_batches=min_micro_batches,
            seed=seed,
            epoch=epoch,
            samples_left=self.samples_left,
        )
        self.samples_seen = 0
        self.steps = 0
        self.epoch_samples_done = 0  # the sampler's position: samples of the committed windows, skipped ones too
        self.window: Window | None = None
        self.micro = 0
        self.fed = [0, 0]  # samples whose backward ran in this window: first half, second half (all ranks)
        self.lr_factor = 1.0
        self.window_rng: dict[str, Any] | None = None  # the generator states as the current window started
        self.resumption = Resumption()
        if restart is not None:
            self.resumption = resume(self, restart, warn, info)
        self.validation_interval()  # refuses an interval validation would never reach, before training

    # ------------------------------------------------------------------------------ one optimizer step
    def follow(self, epoch: Callable[[], int], measurement: Measurement) -> None:
        """A later fit continues the run: its epochs and its measurement from now on."""
        self.epoch = self.schedule.epoch = epoch
        self.measurement = measurement

    def start_epoch(self) -> int:
        """A training epoch starts: its estimated number of micro-batches (for the progress bar)."""
        resume = self.schedule.resume_from
        resumed = resume is not None and resume.epoch == self.epoch()
        self.epoch_samples_done = resume.samples_done if resume is not None and resumed else 0
        # the epoch's micro-batches if every window were planned at the batch size asked for now
        samples = int(min(self.epoch_samples() - self.epoch_samples_done, max(self.samples_left(), 1)))
        window = self.schedule.plan(max(1, min(self.schedule.batch_size, samples)))
        return math.ceil(samples * window.num_micro_batches / window.total)

    def start_micro_batch(self, params: Sequence[Tensor]) -> MicroBatch:
        """The next micro-batch the training loop runs: which window and slot the sampler planned it for."""
        self.resumption.at_first_batch()
        window, micro = self.schedule.current.next_micro_batch()
        self.window, self.micro = window, micro
        if micro == 0:
            self.window_rng = rng_state()  # a checkpoint written inside this window resumes from its start
            self.fed = [0, 0]
        self.measurement.start_micro_batch(window, micro, params)
        local = window.sizes[micro][self.rank]
        self.lr_factor = self.factor_for(window.total)
        divisor = window.total / (self.world_size * local) if local else math.inf
        reduces = self.measurement.midpoint_reduction and micro == window.half_split() - 1
        return MicroBatch(window, micro, local, divisor, self.lr_factor, reduces)

    def after_backward(self, params: Sequence[Tensor]) -> None:
        """The micro-batch's backward has run: its samples count for its half."""
        window = self.window
        if window is None:
            return
        self.fed[self.micro >= window.half_split()] += sum(window.sizes[self.micro])
        self.measurement.after_backward(window, self.micro, (self.fed[0], self.fed[1]), params)

    def finish_step(self, params: Sequence[Tensor], loss_scale: LossScale) -> Step:
        """Collect, decide and commit, before the optimizer steps with the window's gradient."""
        window = self.window
        if window is None:
            raise RuntimeError("`finish_step` before any micro-batch of the window started")
        stats = self.measurement.collect(loss_scale)  # the halves
        fed = sum(self.fed)
        if 0 < fed < window.total:
            # micro-batches were skipped (`training_step` returned None): a mean over what was fed
            _compat.foreach_mul_([p.grad for p in params if p.grad is not None], window.total / fed)
            self.lr_factor = self.factor_for(fed)
        if stats is not None:  # decide
            next_size = self.controller.update(stats, adjust=self.settings.adjust, population=self.population())
            if self.settings.adjust:
                self.schedule.batch_size = next_size
        self.schedule.current.commit()  # commit
        epoch_before, total_before = self.epoch_samples_done, self.samples_seen
        self.samples_seen += fed
        # the epoch's position is where the sampler stands: the whole window it drew, skipped micro-batches too
        self.epoch_samples_done += window.total
        step = Step(
            index=self.steps,
            samples=fed,
            stats=stats,
            window=window,
            micro_batches=self.micro + 1,
            lr_factor=self.lr_factor,
            epoch_span=(epoch_before, self.epoch_samples_done),
            total_span=(total_before, self.samples_seen),
        )
        self.steps += 1
        return step

    def end_epoch(self) -> None:
        """The training epoch ended; a window it abandoned is dropped, as plain Lightning drops it."""
        if self.schedule.current.inside_window:
            self.measurement.abort()
        self.schedule.resume_from = None

    def close(self) -> None:
        """The fit ended: the gradient is left whole, the generators waiting to be restored forgotten."""
        self.resumption.forget()
        self.measurement.close()

    # ------------------------------------------------------------------------------ readings
    @property
    def done(self) -> bool:
        """The fit's sample budget (``max_samples``, ``max_steps`` in B0-steps) is spent."""
        return self.samples_left() <= 0

    @property
    def local_samples(self) -> int:
        """This rank's samples in the current micro-batch (0: a zero-weight padding sample, or none yet)."""
        return self.window.sizes[self.micro][self.rank] if self.window is not None else 0

    @property
    def without_state(self) -> bool:
        return self.resumption.stage is Stage.WITHOUT_STATE

    @property
    def upcoming_lr_factor(self) -> float:
        """The LR factor of the step the micro-batch being started belongs to; before the first, that of the batch
        size asked for."""
        return self.lr_factor if self.window is not None else self.factor_for(self.schedule.batch_size)

    def generators_to_save(self) -> dict[str, Any]:
        """This rank's generator states a checkpoint written now records (see :class:`Resumption`)."""
        inside = self.schedule.current.inside_window
        return self.resumption.to_save(self.window_rng if inside else None)

    def factor_for(self, samples: int) -> float:
        return lr_factor(samples, self.b0, self.settings.lr_scaling, self.settings.lr_scaling_blend)

    def within_bounds(self, size: int) -> int:
        """A batch size within this fit's bounds (a checkpoint's may lie outside them)."""
        size = max(size, self.controller.min_batch_size)
        high = self.controller.max_batch_size
        return size if high is None else min(size, high)

    # ------------------------------------------------------------------------------ samples
    def epoch_samples(self) -> int:
        """Samples an epoch feeds: the epoch's order, or what ``limit_train_batches`` leaves of it."""
        limit = epoch_limit(
            self.data.epoch_length, self.data.batch_size, self.world_size, self.limits.limit_train_batches
        )
        return self.data.epoch_length if limit is None else limit

    def population(self) -> float:
        """The :math:`N` samples every window is drawn from without replacement: the whole epoch's order on all ranks
        (``limit_train_batches`` takes its first part, still a uniform draw from all of it); ``math.inf`` for an order
        SimiGrad cannot regenerate (a sampler with replacement, weighted, or the user's own), read as independent
        draws."""
        return float(self.data.epoch_length) if self.data.regenerable_order and self.data.epoch_length > 1 else math.inf

    def samples_left(self) -> float:
        """Samples the fit may still train: ``max_samples``, and ``max_steps`` counted in B0-steps."""
        budget = float(self.settings.max_samples) if self.settings.max_samples is not None else math.inf
        if self.settings.schedule_by_samples and self.limits.max_steps != -1:
            budget = min(budget, float(self.limits.max_steps * self.b0))
        return budget - self.samples_seen

    def fit_length(self) -> FitLength:
        return FitLength(
            initial_batch_size=self.b0,
            epoch_samples=self.epoch_samples(),
            drop_last=self.data.drop_last,
            max_epochs=self.limits.max_epochs,
            budget=self.samples_left() + self.samples_seen,
        )

    def counters(self) -> tuple[int, int, int]:
        """``(epoch, epoch_samples_done, samples_seen)`` after the last optimizer step."""
        return self.epoch(), self.epoch_samples_done, self.samples_seen

    def validation_interval(self) -> tuple[int, bool] | None:
        """The validation interval in samples and whether it counts within the epoch; None: at epochs' ends."""
        if not self.limits.validates:
            return None
        return validation_interval(
            self.epoch_samples(),
            self.data.batch_size,
            self.world_size,
            self.limits.val_check_interval,
            self.limits.check_val_every_n_epoch,
        )

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The run's part of the checkpoint (see :mod:`lightning_simigrad.state.checkpoint` for the whole)."""
        return {
            "format_version": FORMAT_VERSION,
            "initial_batch_size": self.b0,
            "samples_seen": self.samples_seen,
            "steps": self.steps,
            "epoch_samples_done": self.epoch_samples_done,
            "epoch_length": self.data.epoch_length,
            "world_size": self.world_size,
            **self.schedule.state_dict(),
            "controller": self.controller.state_dict(),
        }
