r"""One fit of SimiGrad, without Lightning: the life of every optimizer step, from plan to commit.

A :class:`Run` is made when the training data arrives (by the fit's
:class:`~lightning_simigrad.integration.session.FitSession`) and owns the components a step needs -- the
controller, the window schedule the data path plans from, the measurement, the fit's counts and bounds -- each of
which keeps and checkpoints its own state. One optimizer step reads, top to bottom:

1. **plan** -- the data path has already planned the step's window from the controller's batch size, or a fixed
   schedule's (:func:`~lightning_simigrad.data.windows.walk_epoch`): its micro-batches, their sizes on every rank;
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
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from torch import Tensor

from lightning_simigrad.core.controller import BatchSizeController
from lightning_simigrad.core.counts import FitCounts, FitFacts, SchedulerSteps
from lightning_simigrad.core.lr_scaling import lr_factor
from lightning_simigrad.core.plan import Window
from lightning_simigrad.core.sample_counts import Data, FitBounds, Limits
from lightning_simigrad.core.settings import Settings
from lightning_simigrad.core.statistics import HalfStats
from lightning_simigrad.data.schedule import ResumePoint, WindowSchedule
from lightning_simigrad.measurement.protocol import LossScale, Measurement, gradients_of
from lightning_simigrad.state.resume import Restart, Resumption, Stage, generators_of, outside_bounds, without_state
from lightning_simigrad.state.rng import RngSnapshot
from lightning_simigrad.weighing import weighing_for

__all__ = ["MicroBatch", "Run", "Step"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MicroBatch:
    """The micro-batch about to run: its window and slot, and how Lightning must treat it."""

    window: Window
    index: int
    local_samples: int  # this rank's samples (0: a zero-weight padding sample)
    loss_divisor: float  # N / (W n): each sample of the window weighs exactly 1 / N (N / (W t) for t loss items)
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
    weight: int  # their weight (what batch sizes count: the samples, unless counted in another unit)
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
    """The components and the step protocol of one fit (see the module docstring).

    Args:
        settings: the callback's settings.
        data: the training data.
        limits: the Trainer's bounds.
        world_size, rank: the data-parallel group and this rank in it.
        seed: the shuffling seed, agreed on by every rank.
        initial_batch_size: B0.
        epoch: returns the training loop's epoch (the data's epoch, :meth:`epoch`, is this less the schedule's
            ``epoch_offset``).
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
        self.settings, self.rank, self.measurement = settings, rank, measurement
        self.world_size, self.b0 = world_size, initial_batch_size  # the data-parallel ranks; B0
        self._loop_epoch = epoch
        self.facts = FitFacts(initial_batch_size, world_size, data.epoch_length)
        self.bounds = FitBounds(
            data, limits, world_size, initial_batch_size, settings.max_samples, settings.schedule_by_samples
        )
        min_micro_batches = measurement.min_micro_batches  # two halves: in time, or two groups of ranks
        smallest = smallest_measurable_batch(data, world_size * min_micro_batches)
        self.controller = BatchSizeController(
            **controller_args(settings, initial_batch_size, smallest, world_size, warn)
        )
        self.schedule = WindowSchedule(
            batch_size=self.controller.batch_size,
            max_micro_batch_size=micro_batch_cap(settings, data),
            world_size=world_size,
            min_micro_batches=min_micro_batches,
            seed=seed,
            epoch=self.epoch,
            weight_left=self.weight_left,
            trained=lambda: self.counts.weight_seen,
            planner=None if settings.schedule is None else self.scheduled_size,
            unit=settings.batch_unit,
            weights=data.weights,
        )
        self.counts = FitCounts()
        self.scheduler_steps = SchedulerSteps()  # advanced by the integration, which steps the schedulers
        # the window being trained
        self.window: Window | None = None
        self.micro = 0
        self.fed = [0, 0]  # samples whose backward ran in this window: first half, second half (all ranks)
        self.fed_weight = 0  # their weight
        self.lr_factor = 1.0
        self._warn = warn
        self._told_unmeasured = False  # a step that could not be measured is said once a fit
        self.window_rng: RngSnapshot | None = None  # the generator states as the current window started
        # with `loss_items`: every loss item of a step weighs 1 / (the step's items); else every sample 1 / N
        self.weighing = weighing_for(settings.batch_unit.loss_items, world_size)
        self.resumption = restore(self, restart, warn, info) if restart is not None else Resumption()
        self.bounds.validation_interval()  # refuses an interval validation would never reach, before training

    # ------------------------------------------------------------------------------ the data and the fit
    @property
    def data(self) -> Data:
        return self.bounds.data

    def epoch(self) -> int:
        """The epoch of the data being trained: the training loop's, unless a resume made them part
        (:meth:`~lightning_simigrad.state.resume.Restart.placed`)."""
        return self._loop_epoch() - self.schedule.epoch_offset

    def follow(self, epoch: Callable[[], int], measurement: Measurement) -> None:
        """A later fit continues the run: its epochs and its measurement from now on."""
        self._loop_epoch = epoch
        self.schedule.epoch_offset = 0
        self.measurement = measurement

    def reload(self, data: Data, limits: Limits) -> None:
        """The training data as Lightning loaded it this time (a reloaded DataLoader, a later fit's Trainer)."""
        self.bounds = replace(self.bounds, data=data, limits=limits)
        self.schedule.weights = data.weights

    # ------------------------------------------------------------------------------ one optimizer step
    def start_epoch(self) -> None:
        """A training epoch starts: at the samples a resumed epoch had committed, else at its first."""
        resume = self.schedule.resume_from
        resumed = resume is not None and resume.epoch == self.epoch()
        self.counts.start_epoch(resume.samples_done if resume is not None and resumed else 0)

    def start_micro_batch(self, params: Sequence[Tensor], batch: Any = None) -> MicroBatch:
        """The next micro-batch the training loop runs: which window and slot the data path planned it for
        (``batch``: what it trains on, for ``loss_items`` to count)."""
        self.resumption.at_first_batch()
        window, micro = self.schedule.current.next_micro_batch()
        self.window, self.micro = window, micro
        if micro == 0:
            self.window_rng = RngSnapshot()  # a checkpoint written inside this window resumes from its start
            self.fed, self.fed_weight = [0, 0], 0
        self.measurement.start_micro_batch(window, micro, params)
        local = window.sizes[micro][self.rank]
        self.lr_factor = self.factor_for(window.weight)
        weight = self.weighing.start(batch, micro, local)  # what its mean loss stands for: samples, or loss items
        divisor = window.total / (self.world_size * weight) if weight else math.inf
        reduces = self.measurement.midpoint_reduction and micro == window.half_split() - 1
        return MicroBatch(window, micro, local, divisor, self.lr_factor, reduces)

    def after_backward(self, params: Sequence[Tensor]) -> None:
        """The micro-batch's backward has run: its samples count for its half."""
        window = self.window
        if window is None:
            return
        self.fed[self.micro >= window.half_split()] += sum(window.sizes[self.micro])
        self.fed_weight += window.micro_weight(self.micro)
        self.weighing.after_backward(self.measurement.half_of(window, self.micro))
        self.measurement.after_backward(window, self.micro, (self.fed[0], self.fed[1]), params)

    def finish_step(self, params: Sequence[Tensor], loss_scale: LossScale) -> Step:
        """Collect, decide and commit, before the optimizer steps with the window's gradient."""
        window = self.window
        if window is None:
            raise RuntimeError("`finish_step` before any micro-batch of the window started")
        fed = sum(self.fed)
        columns = self.weighing.columns()  # what the weighing needs from every rank rides with the halves' products
        stats = (
            self.measurement.collect(loss_scale) if columns is None else self.measurement.collect(loss_scale, columns)
        )
        grads = partial(gradients_of, self.measurement, params)  # where the gradient is held, read if it is needed
        stats = self.weighing.finish(grads, window.total, fed, stats, columns)  # the step's mean, the halves' means
        if 0 < fed < window.total:
            self.lr_factor = self.factor_for(self.fed_weight)
        if stats is not None:  # decide
            population = self.bounds.population()
            next_size = self.controller.update(stats, adjust=self.settings.adjust, population=population)
            if self.settings.adjust:
                self.schedule.batch_size = next_size
        self.schedule.current.commit()  # commit
        total_before = self.counts.samples_seen
        # the epoch's position is where the sampler stands: the whole window it drew, skipped micro-batches too
        epoch_span = self.counts.commit(samples=fed, weight=self.fed_weight, epoch_samples=window.total)
        if self.settings.schedule is not None:  # what the checkpoint and the readings show as the batch asked for
            self.schedule.batch_size = self.scheduled_size(self.counts.weight_seen)
        unmeasured = stats is None or not math.isfinite(stats.similarity)
        if unmeasured and self.settings.schedule is None and not self.done and not self._told_unmeasured:
            self._told_unmeasured = True  # (the fit's last window, cut to what the budget left, may be too small)
            self._warn(unmeasured_step(self.counts.steps - 1, fed, window))
        return Step(
            index=self.counts.steps - 1,
            samples=fed,
            weight=self.fed_weight,
            stats=stats,
            window=window,
            micro_batches=self.micro + 1,
            lr_factor=self.lr_factor,
            epoch_span=epoch_span,
            total_span=(total_before, self.counts.samples_seen),
        )

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
        """The fit's budget (``max_samples``, ``max_steps`` in B0-steps) is spent."""
        return self.weight_left() <= 0

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
        return self.resumption.to_save(self.window_rng.state() if inside and self.window_rng is not None else None)

    def scheduled_size(self, trained: int) -> int:
        """A fixed schedule's batch size after ``trained`` weight, within this fit's bounds (the smallest batch a
        measurement needs may lie above what the schedule was checked against)."""
        assert self.settings.schedule is not None
        return self.within_bounds(self.settings.schedule(trained))

    def factor_for(self, weight: int) -> float:
        """The learning-rate factor of a step of ``weight``."""
        return lr_factor(weight, self.b0, self.settings.lr_scaling, self.settings.lr_scaling_blend)

    def within_bounds(self, size: int) -> int:
        """A batch size within this fit's bounds (a checkpoint's may lie outside them); a replay's as recorded."""
        if self.settings.schedule is not None and self.settings.schedule.recorded:  # BatchSchedule.recorded: why
            return size
        low, high = self.controller.min_batch_size, self.controller.max_batch_size
        return max(size, low) if high is None else min(max(size, low), high)

    def weight_left(self) -> float:
        """What the fit may still train: its budget less the weight trained."""
        return self.bounds.budget() - self.counts.weight_seen

    def counters(self) -> tuple[int, int, int]:
        """``(epoch, epoch_samples_done, weight_seen)`` after the last optimizer step: where the epoch stands, in
        samples, and what the fit trained, in what batch sizes count (B0-steps are counted in it)."""
        return self.epoch(), self.counts.epoch_samples_done, self.counts.weight_seen

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, dict[str, Any]]:
        """The run's components' pieces of the checkpoint (:mod:`lightning_simigrad.state.checkpoint`)."""
        return {
            "run": self.facts.state_dict(),
            "counts": self.counts.state_dict(),
            "schedule": self.schedule.state_dict(),
            "controller": self.controller.state_dict(),
            "progress": self.scheduler_steps.state_dict(),
        }


@dataclass(frozen=True)
class SmallestBatch:
    """The smallest batch a measurement can be taken on: ``samples`` samples (one in each of the halves' slots on every
    rank), which is ``size`` in what batch sizes count (tokens: at the data's mean tokens a sample)."""

    samples: int
    size: int
    tokens: bool = False

    def why(self, world_size: int) -> str:
        """What the smallest batch is, in words."""
        ranks = f"{world_size} rank(s)"
        if not self.tokens:
            return f"the {self.samples} samples a measurement needs on {ranks}"
        return (
            f"the {self.samples} sequences a measurement needs on {ranks}, {self.size} tokens at the training data's"
            " mean tokens a sequence"
        )


def controller_args(
    settings: Settings, initial_batch_size: int, smallest: SmallestBatch, world_size: int, warn: Callable[[str], None]
) -> dict[str, Any]:
    """The controller's arguments for this fit: its bounds no lower than ``smallest`` (a ``min_batch_size`` below it
    is raised, with a warning; a ``max_batch_size`` below it refused)."""
    args = settings.controller_args(initial_batch_size, min_batch_size=smallest.size)
    if args["max_batch_size"] is not None and args["max_batch_size"] < args["min_batch_size"]:
        raise ValueError(f"`max_batch_size` ({args['max_batch_size']}) is below {smallest.why(world_size)}. Raise it.")
    if settings.min_batch_size is not None and settings.min_batch_size < smallest.size:
        warn(
            f"`min_batch_size={settings.min_batch_size}` is below {smallest.why(world_size)}: the batch never goes"
            f" below {smallest.size}."
        )
    return args


def unmeasured_step(index: int, samples: int, window: Window) -> str:
    """The warning for a step whose halves could not be compared."""
    return (
        f"SimiGrad could not measure optimizer step {index}: its window held {samples} samples in micro-batches of"
        f" {[list(sizes) for sizes in window.sizes]} (per rank), and its halves' similarity is NaN. The controller"
        " holds the batch size through such steps; `simigrad/similarity` logs each as NaN. Said once per fit."
    )


def smallest_measurable_batch(data: Data, samples: int) -> SmallestBatch:
    """The smallest batch a measurement can be taken on, for ``samples`` samples a measured window needs.

    >>> smallest_measurable_batch(Data(100, 8, False, weight=1234), 2)
    SmallestBatch(samples=2, size=25, tokens=True)
    """
    if data.weight is None or not data.epoch_length:
        return SmallestBatch(samples, samples)
    return SmallestBatch(samples, math.ceil(samples * data.weight / data.epoch_length), tokens=True)


def micro_batch_cap(settings: Settings, data: Data) -> int:
    """Most samples of a slot: ``max_micro_batch_size``, else the DataLoader's batch, unless micro-batches are bounded
    by weight (``max_micro_batch_tokens``), which then bound them alone."""
    if settings.max_micro_batch_size is not None:
        return settings.max_micro_batch_size
    return data.batch_size if settings.batch_unit.max_slot_weight is None else 2**62


def restore(run: Run, restart: Restart, warn: Callable[[str], None], info: Callable[[str], None]) -> Resumption:
    """Pick ``run`` up where ``restart``'s checkpoint left it, or refuse a resume that cannot be exact: every
    component of the run takes its own piece back."""
    if restart.state is None:
        warn(without_state(restart))
        # counted as the fixed-batch run that wrote the checkpoint counted: its steps were B0 (samples, or a weight:
        # then as many samples as the data's mean weight gives)
        weight, data = restart.global_step * run.b0, run.data
        per_sample = 1.0 if data.weight is None or not data.epoch_length else data.weight / data.epoch_length
        run.counts = FitCounts(restart.global_step, round(weight / per_sample), weight)
        return Resumption(Stage.WITHOUT_STATE)
    restart = restart.placed(run.data, run.world_size, warn)
    saved = restart.saved
    run.controller.load_state_dict(saved.controller)
    run.counts = replace(saved.counts, epoch_samples_done=restart.samples_done)
    run.scheduler_steps.load_state_dict(saved.progress)
    piece = saved.schedule
    batch_size = run.within_bounds(piece.batch_size)
    # a share of the epoch's tail is planned again as it was: the uninterrupted run did not bound it either
    tails = piece.planned_tails + (False,) * (len(piece.planned) - len(piece.planned_tails))
    planned = tuple(size if tail else run.within_bounds(size) for size, tail in zip(piece.planned, tails))
    resume = ResumePoint(piece.epoch, saved.counts.epoch_samples_done, planned)
    run.schedule.load_state_dict(replace(piece, batch_size=batch_size, epoch_offset=restart.epoch_offset), resume)
    if batch_size != piece.batch_size or planned != piece.planned:
        bounds = (run.controller.min_batch_size, run.controller.max_batch_size)
        need = run.schedule.world_size * run.schedule.min_micro_batches
        asked, brought = (piece.batch_size, list(piece.planned)), (batch_size, list(planned))
        warn(outside_bounds(restart, asked, brought, bounds, need, run.world_size))
    if saved.facts.world_size != run.world_size:
        info(
            f"SimiGrad: resuming a checkpoint written on {saved.facts.world_size} rank(s) on {run.world_size}: batch"
            f" size {batch_size}, B0 {run.b0}, {run.counts.samples_seen} samples seen; the rest of epoch"
            f" {piece.epoch} is shared among the {run.world_size} rank(s)."
        )
    return generators_of(restart, run.world_size, run.rank)
