"""SimiGrad: adaptive batch size from the similarity of two half-batch gradients, as one Callback.

The callback validates its arguments when it is made; each fit is a
:class:`~lightning_simigrad.integration.session.FitSession`, made in ``setup`` and closed in ``teardown`` (or when
the fit fails), which attaches SimiGrad's adapters to Lightning and forwards every hook to the fit's
:class:`~lightning_simigrad.run.Run`. See ``docs/architecture.md`` for the layers and one step's life.
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
from torch.optim import Optimizer
from typing_extensions import override

from lightning_simigrad.core.settings import Settings
from lightning_simigrad.integration.readings import Readings
from lightning_simigrad.integration.reporting import METRICS
from lightning_simigrad.integration.session import FitSession

__all__ = ["METRICS", "SimiGrad"]


class SimiGrad(Readings):
    r"""Adapt the global batch size every optimizer step to hold the half-batch gradient similarity.

    Every optimizer step measures the cosine similarity of the mean gradients of two halves of the global
    batch -- the two halves of the accumulation window on one process and under FSDP2, two groups of ranks under
    DDP and FSDP1 -- and grows or shrinks the batch to hold it at ``target_similarity``, scaling the learning rate
    to match. The LightningModule, optimizer, scheduler and DataLoader stay as they are.

    Args:
        target_similarity: cosine similarity of the two halves' gradients to hold, in (-1, 1). At
            equilibrium the batch is :math:`B^* = 2 B_{noise} \tau / (1 - \tau)`: 0.8 gives 8 noise scales.
        min_batch_size: smallest global batch (default: what a measurement needs: 2 on one process, the world
            size under DDP).
        max_batch_size: largest global batch (default: unbounded).
        max_micro_batch_size: most samples per device in one forward/backward (default: the DataLoader's
            ``batch_size``, or what a ``BatchSizeFinder`` found). Larger windows accumulate more micro-batches.
        initial_batch_size: B0 (default: the DataLoader's batch size x world size x
            ``accumulate_grad_batches``). The learning rate the user configured belongs to B0.
        lr_scaling: ``"sqrt"`` (the paper: lr x sqrt(B / B0)), ``"linear"`` or ``"none"``.
        lr_scaling_blend: the paper's blend f: the factor becomes ``(factor - 1) * f + 1``.
        schedule_by_samples: count step-interval LR schedulers, ``max_steps`` and
            ``trainer.estimated_stepping_batches`` in steps of B0 samples, so that a schedule written for B0
            follows the data trained (see :mod:`lightning_simigrad.integration.sample_schedules`). ``False``:
            Lightning's own counting, per optimizer step.
        max_samples: end the fit after this many samples (the last step takes exactly what is left).
        progress_bar: show the batch size, similarity and noise scale in the progress bar's postfix.
        history_size: how many of the latest steps :attr:`history` keeps (None: every step of the fit, 0: none).
            Loggers and ``trainer.callback_metrics`` receive every step whatever it is.
        loss_items: ``loss_items(batch)``, a micro-batch's number of loss items (labelled tokens, e.g.
            ``lambda b: (b["labels"] != -100).sum()``), for a ``training_step`` that returns the mean loss over them:
            every item of a step then weighs exactly 1 / (the step's items, all ranks), the halves are item means,
            and the batch still counts samples (see :mod:`lightning_simigrad.weighing`). Under ``ddp_spawn`` it
            must be picklable (a module-level function).
        adjust: ``False`` measures and logs but never changes the batch (the paper's ``enable_adjust``).
        controller: ``"paper"`` (x ``grow_factor`` below target, x ``shrink_factor`` above),
            ``"noise_scale"`` (jump to :math:`B^*` from the smoothed measured noise scale) or ``"ratchet"`` (grow
            towards :math:`B^*` by at most ``grow_factor`` a step, never shrink). With ``lengths`` :math:`B^*` is
            carried into tokens by the step's tokens per sample.
        grow_factor, shrink_factor: the paper rule's factors; ``grow_factor`` is the ratchet's largest step.
        smoothing: EMA decay of the similarity the paper rule compares (0: none).
        noise_scale_decay: EMA decay of the noise-scale numerator and denominator.
        deadband: no change while the similarity is within this distance of the target.
        warmup_steps: measured steps before the first change.

    Every argument after ``target_similarity`` is keyword-only; they are declared once, in
    :class:`~lightning_simigrad.core.settings.Settings`, and read back as attributes (``callback.max_batch_size``).

    Raises:
        ValueError: at construction, for arguments out of range; when a checkpoint is restored, for a SimiGrad
            state that is malformed or of another format version, and for a checkpoint written in the middle
            of an epoch of a training set of another size.
        RuntimeError: at setup, for a setup it cannot serve (manual optimization, DeepSpeed, FSDP1 with hybrid or no
            sharding or CPU offload, ``GradientAccumulationScheduler``, a ``training_step`` that takes
            ``dataloader_iter``, a Lightning without the members it needs), and before the first step for a
            training DataLoader without a ``batch_size`` or over a map-style dataset without a length, and for a
            stream's mid-epoch resume it cannot make exact.
        MeasurementError: under DDP and FSDP, on every rank at the same step, when the measurement failed on any rank.

    The loss that ``training_step`` returns must be the mean over its micro-batch (the default of every torch
    loss): each sample of a step is then weighed by exactly ``1 / batch_size``.

    Example::

        from lightning_simigrad import SimiGrad

        trainer = L.Trainer(callbacks=[SimiGrad(target_similarity=0.8, min_batch_size=64,
                                                max_batch_size=65536, max_micro_batch_size=128)])
        trainer.fit(model, DataLoader(dataset, batch_size=64, shuffle=True, num_workers=2))
    """

    def __init__(self, target_similarity: float, **arguments: Any) -> None:
        if "schedule" in arguments:
            raise TypeError(
                "SimiGrad() got an unexpected keyword argument 'schedule': for a fixed batch-size schedule use"
                " `BatchSizeSchedule(schedule, ...)` instead of SimiGrad."
            )
        super().__init__(Settings(target_similarity, **arguments))  # validated here, before any Trainer exists

    __init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            # SimiGrad always holds a target: None belongs to BatchSizeSchedule's settings alone
            *(
                p.replace(annotation="float") if name == "target_similarity" else p
                for name, p in inspect.signature(Settings).parameters.items()
                if name != "schedule"
            ),
        ]
    )
    ARGUMENTS = frozenset(Settings.__dataclass_fields__) - {"schedule"}  # what reads back as an attribute

    def __getattr__(self, name: str) -> Any:  # the arguments, read as attributes: `callback.target_similarity`
        settings = self.__dict__.get("settings")
        if settings is None or name not in type(self).ARGUMENTS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(settings, name)

    # ------------------------------------------------------------------------------ the fit
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._origin.discard()  # a fit in this process supersedes an unread spawned one
        self._session = FitSession(self.settings, self.reporting, self, trainer, pl_module, carried=self._carried)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit().fit_start(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit().train_start(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit().train_epoch_start(trainer)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._fit().train_batch_start(trainer, pl_module, batch)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit().after_backward(pl_module)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self._fit().before_optimizer_step(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._fit().train_batch_end(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit().train_epoch_end()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit().train_end(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._close()
        if self._origin.in_copy and trainer.is_global_zero:  # a spawned child: for the launching process
            self._origin.send(self.spawn_state())

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips `teardown` after an error: leave the gradient whole and the Trainer as it was
        if self._session is not None:
            self._session.exception(trainer, exception)
        self._close()

    def _fit(self) -> FitSession:
        if self._session is None:
            raise RuntimeError("SimiGrad's hooks run inside `trainer.fit`, after `setup`.")
        return self._session

    def _close(self) -> None:
        if self._session is not None:
            self._carried = self._session.close()
            self._session = None
