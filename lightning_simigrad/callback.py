"""SimiGrad: adaptive batch size from the similarity of two half-batch gradients, as one Callback.

The callback validates its arguments, attaches SimiGrad's adapters to Lightning for the length of a fit and
forwards each hook to the fit's :class:`~lightning_simigrad.run.Run`, which owns the controller, the windows
and the measurement. See ``docs/architecture.md`` for the layers and one step's life.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer
from typing_extensions import override

from lightning_simigrad import _compat
from lightning_simigrad.core.settings import Settings
from lightning_simigrad.integration import data_source, neighbours
from lightning_simigrad.integration.accumulation import VariableAccumulation
from lightning_simigrad.integration.callback_state import CallbackState
from lightning_simigrad.integration.lr_scaler import StepLRScaler
from lightning_simigrad.integration.progress import SampleProgress
from lightning_simigrad.integration.progress_bar import EpochProgress
from lightning_simigrad.integration.reporting import METRICS, Reporting
from lightning_simigrad.integration.spawn_results import Origin
from lightning_simigrad.measurement.protocol import loss_scale_of
from lightning_simigrad.run import Run

__all__ = ["METRICS", "SimiGrad"]


class SimiGrad(CallbackState):
    r"""Adapt the global batch size every optimizer step to hold the half-batch gradient similarity.

    Every optimizer step measures the cosine similarity of the mean gradients of two halves of the global
    batch -- the two halves of the accumulation window on one process, two groups of ranks under DDP -- and
    grows or shrinks the batch to hold it at ``target_similarity``, scaling the learning rate to match. The
    LightningModule, optimizer, scheduler and DataLoader stay as they are.

    Args:
        target_similarity: cosine similarity of the two halves' gradients to hold, in (-1, 1). At
            equilibrium the batch is :math:`B^* = 2 B_{noise} \tau / (1 - \tau)`: 0.8 gives 8 noise scales.
        min_batch_size: smallest global batch (default: 2 on one process, the world size under DDP).
        max_batch_size: largest global batch (default: unbounded).
        max_micro_batch_size: most samples per device in one forward/backward (default: the DataLoader's
            ``batch_size``, or what a ``BatchSizeFinder`` found). Larger windows accumulate more micro-batches.
        adjust: ``False`` measures and logs but never changes the batch (the paper's ``enable_adjust``).
        lr_scaling: ``"sqrt"`` (the paper: lr x sqrt(B / B0)), ``"linear"`` or ``"none"``.
        lr_scaling_blend: the paper's blend f: the factor becomes ``(factor - 1) * f + 1``.
        controller: ``"paper"`` (x ``grow_factor`` below target, x ``shrink_factor`` above) or
            ``"noise_scale"`` (jump to :math:`B^*` from the smoothed measured noise scale).
        initial_batch_size: B0 (default: the DataLoader's batch size x world size x
            ``accumulate_grad_batches``). The learning rate the user configured belongs to B0.
        grow_factor, shrink_factor: the paper rule's factors.
        smoothing: EMA decay of the similarity the paper rule compares (0: none).
        noise_scale_decay: EMA decay of the noise-scale numerator and denominator.
        deadband: no change while the similarity is within this distance of the target.
        warmup_steps: measured steps before the first change.
        schedule_by_samples: count step-interval LR schedulers, ``max_steps`` and
            ``trainer.estimated_stepping_batches`` in steps of B0 samples, so that a schedule written for B0
            follows the data trained (see :mod:`lightning_simigrad.integration.progress`). ``False``:
            Lightning's own counting, per optimizer step.
        max_samples: end the fit after this many samples (the last step takes exactly what is left).
        progress_bar: show the batch size, similarity and noise scale in the progress bar's postfix.
        history_size: how many of the latest steps :attr:`history` keeps (None: every step of the fit, 0: none).
            Loggers and ``trainer.callback_metrics`` receive every step whatever it is.

    Raises:
        ValueError: at construction, for arguments out of range; when a checkpoint is restored, for a SimiGrad
            state that is malformed or of another format version, and for a checkpoint written in the middle
            of an epoch of a training set of another size.
        RuntimeError: at setup, for a setup it cannot serve (manual optimization, a strategy other than
            single-device or DDP, ``GradientAccumulationScheduler``, a ``training_step`` that takes
            ``dataloader_iter``, a Lightning without the members it needs), and before the first step for a
            training DataLoader without a sized map-style dataset.
        MeasurementError: under DDP, on every rank at the same step, when the measurement failed on any rank.

    The loss that ``training_step`` returns must be the mean over its micro-batch (the default of every torch
    loss): each sample of a step is then weighed by exactly ``1 / batch_size``.

    Example::

        from lightning_simigrad import SimiGrad

        trainer = L.Trainer(callbacks=[SimiGrad(target_similarity=0.8, min_batch_size=64,
                                                max_batch_size=65536, max_micro_batch_size=128)])
        trainer.fit(model, DataLoader(dataset, batch_size=64, shuffle=True, num_workers=2))
    """

    def __init__(
        self,
        target_similarity: float,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        max_micro_batch_size: int | None = None,
        adjust: bool = True,
        lr_scaling: str = "sqrt",
        lr_scaling_blend: float = 1.0,
        controller: str = "paper",
        initial_batch_size: int | None = None,
        grow_factor: float = 1.1,
        shrink_factor: float = 0.9,
        smoothing: float = 0.0,
        noise_scale_decay: float = 0.9,
        deadband: float = 0.0,
        warmup_steps: int = 0,
        schedule_by_samples: bool = True,
        max_samples: int | None = None,
        progress_bar: bool = True,
        history_size: int | None = 10_000,
    ) -> None:
        arguments = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        self.settings = Settings(**arguments)  # validated here, before any Trainer exists
        self.run: Run | None = None  # the fit's, from the moment its training data arrives
        self.reporting = Reporting(self.settings.history_size)
        self._restored: dict[str, Any] | None = None  # SimiGrad's state in the checkpoint the fit resumes from
        self._resuming = False  # the fit resumes from a checkpoint (with or without SimiGrad's state)
        self._finished: dict[str, Any] = {}  # the state of a fit that ran in spawned processes, and its summary
        self._finished_summary: dict[str, int] = {}
        self._origin = Origin.of(self)
        self._trainer: pl.Trainer | None = None
        self._active = False  # False while a tuner runs its trials: SimiGrad then stays out of the way
        self._tuned_from: int | None = None  # the DataLoader's batch size before a BatchSizeFinder tuned it
        self._seed = 0  # the shuffling seed, agreed on by all ranks in `setup`
        self._accumulation, self._lr = VariableAccumulation(), StepLRScaler()
        self._progress = SampleProgress(self.settings.schedule_by_samples)
        self._lr_monitors = neighbours.AppliedLRMonitor(self._upcoming_lr_factor)
        self._bar = EpochProgress(self._postfix)

    def __getattr__(self, name: str) -> Any:  # the arguments, read as attributes: `callback.target_similarity`
        settings = self.__dict__.get("settings")
        if settings is None or name not in Settings.__dataclass_fields__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(settings, name)

    # ------------------------------------------------------------------------------ the fit
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _compat.check(trainer)
        neighbours.refuse_unsupported(trainer, pl_module, self.settings.max_micro_batch_size)
        self._trainer = trainer
        self._origin.discard()  # a fit in this process supersedes an unread spawned one
        neighbours.run_before_other_callbacks(trainer, self)
        # the shuffling seed comes from torch's RNG (so `seed_everything` governs it) and rank 0's wins
        self._seed = int(trainer.strategy.broadcast(int(torch.randint(0, 2**31 - 1, (1,)).item()), src=0))
        data_source.AdaptiveDataSource.install(trainer, self._adapt_dataloader)
        # a tuner's trials (in its `on_fit_start`, which Lightning runs before ours) train plain batches
        self._active = self._progress.active = not neighbours.tuners(trainer)
        if not self._active:
            self._tuned_from = neighbours.batch_size_before_tuning(trainer, pl_module)
        if self.run is not None:  # a second fit continues the run, measuring on this fit's model, counting its epochs
            self.run.follow(lambda: data_source.epoch_being_trained(trainer), data_source.measurement_for(trainer))
        self._progress.attach(trainer)

    def _adapt_dataloader(self, loader: Any) -> Any:
        neighbours.check_dataloader(loader)
        if not self._active:
            return loader
        trainer = self._trainer
        assert trainer is not None
        order = data_source.training_order(trainer, loader)
        limits = data_source.limits_of(trainer, self._progress.setting)
        if self.run is None:
            restart = data_source.restart_of(trainer, self._restored) if self._resuming else None
            self.run = data_source.start_run(
                trainer, self.settings, loader, order, limits, self._seed, restart, self._tuned_from
            )
            self._progress.start(self.run, (self._restored or {}).get("progress", {}))
        # as Lightning loads them this time (a reloaded DataLoader, a later fit's Trainer)
        self.run.data, self.run.limits = data_source.data_of(loader, order), limits
        return data_source.adaptive_loader(loader, order, self.run)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        neighbours.refuse_several_optimizers(trainer)
        if not self._active:  # the tuners are done: train from here with adaptive windows
            self._active = self._progress.active = True
            data_source.AdaptiveDataSource.reload(trainer)  # through our source, at the tuned batch size
        self._accumulation.attach(trainer)
        self._lr.attach(trainer.optimizers[0])
        self._lr_monitors.attach(trainer)
        if self.settings.progress_bar:
            self._bar.attach(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # here rather than in `on_fit_start`, after every other callback's: a communication hook one of them
        # registers there is then found and refused with a clear error, not met by torch's own
        if self.run is not None:
            data_source.attach_measurement(self.run.measurement, trainer, pl_module, self.run.world_size)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run is not None and self._active:
            self._bar.start_epoch(trainer, self.run.start_epoch())

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        run = self.run
        if run is None or not self._active:
            return
        micro = run.start_micro_batch(list(pl_module.parameters()))
        if micro.first:
            self._progress.start_window(micro.window.total)
        self._bar.update(trainer, run.schedule.current)
        self._accumulation.set_micro_batch(
            micro.first, micro.last, micro.loss_divisor, micro.window.num_micro_batches, micro.reduces
        )
        # Lightning runs the window's last micro-batch inside `optimizer.step`, after its pre-hook
        self._lr.factor = micro.lr_factor

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run is not None and self._active:
            self.run.after_backward(list(pl_module.parameters()))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        run = self.run
        if run is None or not self._active:
            return
        # the backward ran under the GradScaler's scale, which its `update` changes only after the step
        scale = loss_scale_of(getattr(trainer.precision_plugin, "scaler", None))
        step = run.finish_step(list(pl_module.parameters()), scale)
        if step.skipped_micro_batches:
            self._lr.rescale(step.lr_factor)
        self._progress.record_step(*step.epoch_span, *step.total_span)
        row = self.reporting.record(step, run, self._lr.applied_lr(), self._progress.steps_done())
        self.reporting.publish(trainer, row, step.index)
        if run.done:
            self._progress.end_fit()  # `max_samples` (or `max_steps` in B0-steps) reached exactly: stop

    def _postfix(self) -> dict[str, str] | None:
        return self.reporting.postfix(self.run) if self.run is not None else None

    def _upcoming_lr_factor(self) -> float:  # for the LR monitors
        return self.run.upcoming_lr_factor if self.run is not None and self._active else 1.0

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run is not None:
            self.run.end_epoch()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run is not None and self._active and trainer.is_global_zero and self.run.steps:
            self.reporting.announce(trainer, self.reporting.summary(self.run))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._detach(trainer)
        if self._origin.in_copy and trainer.is_global_zero:  # a spawned child: for the launching process
            self._origin.send(self.spawn_state())

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips `teardown` after an error: leave the gradient whole and the Trainer as it was
        self._detach(trainer)

    def _detach(self, trainer: pl.Trainer) -> None:
        if self.run is not None:
            self.run.close()  # a fit stopped inside a window leaves the gradient whole
        for adapter in (self._accumulation, self._lr, self._lr_monitors, self._bar, self._progress):
            adapter.detach()
        data_source.AdaptiveDataSource.uninstall(trainer)
        self._active = False
