"""One fit of the SimiGrad callback, from ``setup`` to ``teardown``: what it attaches to Lightning, and its run.

The callback makes a :class:`FitSession` when a fit starts and drops it when the fit ends; every hook of the fit
is a method here. The session checks the setup, agrees on the shuffling seed, installs the adapters that make
Lightning follow SimiGrad's windows (:mod:`~lightning_simigrad.integration.accumulation`,
:mod:`~lightning_simigrad.integration.sample_schedules`, :mod:`~lightning_simigrad.integration.epoch_length`,
the LR scaler, the monitors, the progress bar's postfix) and takes them all off again, whether the fit ends or
fails. Its :attr:`~FitSession.run` is made when the training data arrives (Lightning loads it after the fit has
started), from the checkpoint being resumed if any, or carried over from the callback's previous fit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lightning_simigrad import _compat
from lightning_simigrad.core.settings import Settings
from lightning_simigrad.integration import neighbours, refusals, trainer_facts
from lightning_simigrad.integration.accumulation import VariableAccumulation
from lightning_simigrad.integration.data_source import AdaptiveDataSource, Source, WeightsRead, source_for
from lightning_simigrad.integration.elastic import ElasticWatch
from lightning_simigrad.integration.epoch_length import EpochLength
from lightning_simigrad.integration.lr_scaler import StepLRScaler
from lightning_simigrad.integration.progress_bar import BarPostfix
from lightning_simigrad.integration.reporting import Reporting
from lightning_simigrad.integration.sample_schedules import SampleSchedules
from lightning_simigrad.measurement.factory import measurement_for
from lightning_simigrad.measurement.protocol import loss_scale_of
from lightning_simigrad.run import Run
from lightning_simigrad.state.checkpoint import Saved
from lightning_simigrad.state.resume import Restart

__all__ = ["Carried", "FitSession", "Phase"]


class Phase(enum.Enum):
    TUNING = "tuning"  # a tuner runs its trials (in its `on_fit_start`, before ours): SimiGrad stays out of the way
    TRAINING = "training"


@dataclass(frozen=True)
class Carried:
    """What a fit leaves to the callback's next fit: its run (which the next fit continues), the batch size the
    DataLoader had before a ``BatchSizeFinder`` tuned it (B0's, the batch the learning rate belongs to), and its
    training data's source (where a checkpoint written after the fit resumes it)."""

    run: Run | None = None
    tuned_from: int | None = None
    source: Source | None = None


class FitSession:
    """The fit being run: its adapters on Lightning, its phase, and the run once the training data has arrived.

    Args:
        settings: the callback's settings.
        reporting: the callback's reporting (its history spans fits).
        callback: the callback, to be run before the other callbacks.
        trainer, pl_module: the fit's.
        carried: what the callback's previous fit left (its run, which this fit continues).
    """

    def __init__(
        self,
        settings: Settings,
        reporting: Reporting,
        callback: pl.Callback,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        carried: Carried,
    ) -> None:
        _compat.check(trainer)
        refusals.refuse_unsupported(trainer, pl_module, settings.max_micro_batch_size)
        self.settings, self.reporting, self.trainer = settings, reporting, trainer
        neighbours.run_before_other_callbacks(trainer, callback)
        # the shuffling seed comes from torch's RNG (so `seed_everything` governs it) and rank 0's wins
        self.seed = int(trainer.strategy.broadcast(int(torch.randint(0, 2**31 - 1, (1,)).item()), src=0))
        tuning = bool(neighbours.tuners(trainer))
        self.phase = Phase.TUNING if tuning else Phase.TRAINING
        before = neighbours.batch_size_before_tuning(trainer, pl_module) if tuning else None
        self.tuned_from = before if before is not None else carried.tuned_from
        # set when Lightning restores a checkpoint, before the data loads: SimiGrad's state in it (None: it has none)
        self.resuming = False
        self.saved: Saved | None = None
        self.source: Source | None = None  # where the training data comes from, once it is loaded
        self._weights = WeightsRead()  # every sample's weight in the unit, read once per dataset
        self._restart: Restart | None = None  # the checkpoint the run started from, as Lightning restored it
        self._run = carried.run
        if self._run is not None:  # continues on this fit's model, counting its epochs
            self._run.follow(
                lambda: trainer_facts.epoch_being_trained(trainer),
                measurement_for(trainer_facts.parallelism_of(trainer)),
            )
        self.accumulation, self.lr = VariableAccumulation(), StepLRScaler()
        self.schedules = SampleSchedules(settings.schedule_by_samples)
        self.schedules.active = not tuning
        if self._run is not None:
            self.schedules.start(self._run, continued=True)
        self.epoch_length = EpochLength()
        self.monitors = neighbours.AppliedLRMonitor(self._upcoming_lr_factor)
        self.bar = BarPostfix(self._postfix)
        self.elastic = ElasticWatch(settings.elastic, trainer) if settings.elastic is not None else None
        AdaptiveDataSource.install(trainer, self._adapt_dataloader)
        self.schedules.attach(trainer)

    @property
    def run(self) -> Run:
        """The fit's run; it exists once Lightning has loaded the training data (before the first epoch)."""
        if self._run is None:
            raise RuntimeError("SimiGrad's run starts when the training data is loaded; it has not been loaded yet.")
        return self._run

    @property
    def started(self) -> bool:
        """The run exists (the training data has been loaded, and no tuner is running its trials)."""
        return self._run is not None and self.phase is Phase.TRAINING

    def resume_from(self, saved: Saved | None) -> None:
        """Lightning restored a checkpoint (with SimiGrad's ``saved`` state, or none): the run is made again from it
        when the data loads."""
        if self._run is not None:
            self._run.resumption.forget()  # an earlier resume's, if its fit ended before a batch
        self._run, self.resuming, self.saved = None, True, saved

    # ------------------------------------------------------------------------------ the data arrives
    def _adapt_dataloader(self, loader: Any) -> Any:
        refusals.check_dataloader(loader)
        if self.phase is Phase.TUNING:
            return loader
        trainer = self.trainer
        source = source_for(trainer, loader, self.settings, self._weights)
        limits = trainer_facts.limits_of(trainer, self.schedules.setting)
        if self._run is None:
            self._run = self._start_run(loader, source.data, limits)
            self.schedules.start(self._run)
        run = self._run
        run.reload(source.data, limits)  # as Lightning loads it this time (a reloaded DataLoader, a later fit)
        self.source = source
        return source.adapt(run, self._restart)

    def _start_run(self, loader: DataLoader, data: Any, limits: Any) -> Run:
        """The fit's run, made when its training data first arrives, measuring as the strategy trains.

        B0 is the checkpoint's, or the one given, or the DataLoader's batch (before a ``BatchSizeFinder`` tuned it) x
        world size x ``accumulate_grad_batches``.
        """
        trainer = self.trainer
        world, rank = trainer_facts.data_parallel(trainer)
        restart = trainer_facts.restart_of(trainer, self.saved) if self.resuming else None
        self._restart = restart
        per_device = self.tuned_from or loader.batch_size
        assert per_device is not None
        b0 = self.saved.facts.initial_batch_size if self.saved is not None else self.settings.initial_batch_size
        initial_batch_size = b0 or per_device * world * int(trainer.accumulate_grad_batches)
        return Run(
            self.settings,
            data,
            limits,
            world,
            rank,
            self.seed,
            initial_batch_size,
            epoch=lambda: trainer_facts.epoch_being_trained(trainer),
            measurement=measurement_for(trainer_facts.parallelism_of(trainer)),
            restart=restart,
            warn=rank_zero_warn,
            info=rank_zero_info,
        )

    # ------------------------------------------------------------------------------ the fit's hooks
    def fit_start(self, trainer: pl.Trainer) -> None:
        refusals.refuse_several_optimizers(trainer)
        if self.phase is Phase.TUNING:  # the tuners are done: train from here with adaptive windows
            self.phase = Phase.TRAINING
            self.schedules.active = True
            AdaptiveDataSource.reload(trainer)  # through our source, at the tuned batch size
        self.accumulation.attach(trainer)
        optimizer = trainer.optimizers[0]
        # DeepSpeed's ZeRO optimizer wraps the torch optimizer it steps, which the LR factor's hooks go on
        self.lr.attach(optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer)
        self.monitors.attach(trainer)
        if self.settings.progress_bar:
            self.bar.attach(trainer)

    def train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # here rather than in `fit_start`, after every other callback's: a communication hook one of them registers
        # there is then found and refused with a clear error, not met by torch's own
        self.run.measurement.attach(trainer_facts.attachment(trainer, pl_module))

    def train_epoch_start(self, trainer: pl.Trainer) -> None:
        self.run.start_epoch()
        if self._sized:  # without a length Lightning's bars count without a total
            self.epoch_length.start_epoch(trainer, self.run)

    def train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any = None) -> None:
        run = self.run
        micro = run.start_micro_batch(list(pl_module.parameters()), batch)
        if micro.first:
            self.schedules.start_window(micro.window.weight)
        if self._sized:
            self.epoch_length.update(trainer, run.schedule.current)
        self.accumulation.set_micro_batch(
            micro.first, micro.last, micro.loss_divisor, micro.window.num_micro_batches, micro.reduces
        )
        # Lightning runs the window's last micro-batch inside `optimizer.step`, after its pre-hook
        self.lr.factor = micro.lr_factor

    def after_backward(self, pl_module: pl.LightningModule) -> None:
        self.run.after_backward(list(pl_module.parameters()))

    def before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.strategy.handles_gradient_accumulation and not self.accumulation.window_end:
            return  # DeepSpeed: Lightning runs this hook after every micro-batch; the engine steps at the window's end
        run = self.run
        # the backward ran under the GradScaler's scale, which its `update` changes only after the step
        scale = loss_scale_of(getattr(trainer.precision_plugin, "scaler", None))
        step = run.finish_step(list(pl_module.parameters()), scale)
        if step.skipped_micro_batches:
            self.lr.rescale(step.lr_factor)
        self.schedules.record_step(*step.epoch_span, *step.total_span)
        row = self.reporting.record(step, run, self.lr.applied_lr(), self.schedules.steps_done())
        if self.elastic is not None:
            row["simigrad/world_size_wanted"] = float(self.elastic.step(run, step))
            self.reporting.annotate(world_size_wanted=row["simigrad/world_size_wanted"])
        self.reporting.publish(trainer, row, step.index)
        if run.done:
            self.schedules.end_fit()  # `max_samples` (or `max_steps` in B0-steps) reached exactly: stop

    def train_batch_end(self, trainer: pl.Trainer) -> None:
        if self.elastic is not None and self.started:
            self.elastic.batch_end(trainer, self.run)

    def exception(self, trainer: pl.Trainer, exception: BaseException) -> None:
        """The fit failed or was stopped: a SIGTERM's checkpoint is written while the run is still whole."""
        if self.elastic is not None and self.started:
            self.elastic.on_exception(trainer, exception)

    def train_epoch_end(self) -> None:
        if self._run is not None:
            self._run.end_epoch()

    def train_end(self, trainer: pl.Trainer) -> None:
        if self.started and trainer.is_global_zero and self.run.counts.steps:
            self.reporting.announce(trainer, self.reporting.summary(self.run), self.run.settings.batch_unit.name)

    def close(self) -> Carried:
        """The fit ended or failed: the gradient left whole, Lightning and the Trainer as they were. Returns what
        the callback's next fit and readings take over."""
        if self._run is not None:
            self._run.close()  # a fit stopped inside a window leaves the gradient whole
        for adapter in (self.accumulation, self.lr, self.monitors, self.bar, self.schedules):
            adapter.detach()
        AdaptiveDataSource.uninstall(self.trainer)
        return Carried(self._run, self.tuned_from, self.source)

    @property
    def _sized(self) -> bool:
        return self.source is None or self.source.sized

    # ------------------------------------------------------------------------------ for the neighbours
    def _postfix(self) -> dict[str, str] | None:
        if not (self.started and self._run is not None):
            return None
        fields = self.reporting.postfix(self._run)
        if fields is not None and self.elastic is not None:
            fields["W"] = f"{self.trainer.world_size}>{self.elastic.world_size_wanted}"  # current > wanted
        return fields

    def _upcoming_lr_factor(self) -> float:  # for the LR monitors
        return self._run.upcoming_lr_factor if self.started and self._run is not None else 1.0
