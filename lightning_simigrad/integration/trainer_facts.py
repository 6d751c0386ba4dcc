"""What the Lightning-free run needs to know of the Trainer, read once where Lightning keeps it.

Everything here reads, nothing changes: the order an epoch follows, the data's facts, the Trainer's bounds, the
epoch being trained, the checkpoint being resumed, the data-parallel group, and how the strategy trains (which
picks the measurement, :func:`~lightning_simigrad.measurement.factory.measurement_for`).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from torch.utils.data import DataLoader, SequentialSampler

from lightning_simigrad.core.sample_counts import Data, Limits
from lightning_simigrad.data.order import EpochOrder
from lightning_simigrad.measurement.factory import Parallelism, Training
from lightning_simigrad.measurement.protocol import Attachment
from lightning_simigrad.state.checkpoint import Saved
from lightning_simigrad.state.resume import Restart

__all__ = [
    "attachment",
    "data_of",
    "data_parallel",
    "epoch_being_trained",
    "limits_of",
    "parallelism_of",
    "restart_of",
    "training_order",
]


def training_order(trainer: pl.Trainer, loader: DataLoader) -> Any:
    """The sampler whose order an epoch follows: the DataLoader's, or in order under ``overfit_batches``."""
    # `overfit_batches` trains the same first samples every epoch, in order
    if getattr(trainer, "overfit_batches", 0) > 0:
        return SequentialSampler(loader.dataset)  # type: ignore[arg-type]
    return loader.sampler


def data_of(loader: DataLoader, order: Any) -> Data:
    assert loader.batch_size is not None  # checked by `refusals.check_dataloader`
    source = EpochOrder(order)
    return Data(len(order), loader.batch_size, loader.drop_last, source.regenerable, sampler=source.name)


def limits_of(trainer: pl.Trainer, setting: Any) -> Limits:
    """The Trainer's bounds; ``setting`` reads the ones Lightning's data loading hides for a while."""
    return Limits(
        limit_train_batches=setting("limit_train_batches"),
        max_steps=trainer.max_steps,
        max_epochs=int(trainer.max_epochs) if trainer.max_epochs is not None else -1,
        val_check_interval=setting("val_check_interval"),
        check_val_every_n_epoch=trainer.check_val_every_n_epoch,
        validates=trainer.limit_val_batches != 0,
    )


def epoch_being_trained(trainer: pl.Trainer) -> int:
    # what Lightning gives samplers' `set_epoch`; unlike `current_epoch` it is already the next epoch
    # when a run resumes from a checkpoint written at an epoch's end
    return int(trainer.fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]


def restart_of(trainer: pl.Trainer, state: Saved | None) -> Restart:
    """The checkpoint the fit resumes from, as Lightning restored it; ``state`` is SimiGrad's part of it."""
    batches = trainer.fit_loop.epoch_loop.batch_progress
    written_inside = trainer.fit_loop.restarting and batches.current.ready > 0 and not batches.is_last_batch
    return Restart(
        path=str(trainer.ckpt_path) if trainer.ckpt_path else "the checkpoint",
        state=state,
        epoch=epoch_being_trained(trainer),
        at_epoch_end=bool(batches.is_last_batch),
        batches_into_epoch=batches.current.ready if written_inside else 0,
        global_step=trainer.global_step,
    )


def data_parallel(trainer: pl.Trainer) -> tuple[int, int]:
    """The number of data-parallel ranks and this process's rank among them (each feeds its own samples)."""
    if isinstance(trainer.strategy, ModelParallelStrategy):  # tensor-parallel ranks would share their samples
        kwargs = trainer.strategy.distributed_sampler_kwargs
        return int(kwargs["num_replicas"]), int(kwargs["rank"])
    return trainer.world_size, trainer.global_rank


def parallelism_of(trainer: pl.Trainer) -> Parallelism:
    """How the Trainer's strategy trains (the refusals have run: it is one SimiGrad serves)."""
    strategy = trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy):
        training = Training.DEEPSPEED
    elif isinstance(strategy, ModelParallelStrategy):
        training = Training.FSDP2
    elif isinstance(strategy, FSDPStrategy):
        training = Training.FSDP1
    else:
        training = Training.SINGLE if trainer.world_size == 1 else Training.DDP
    return Parallelism(training, trainer.world_size)


def attachment(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Attachment:
    """The model a measurement attaches to when training starts: wrapped (DDP, FSDP1, DeepSpeed's engine) or sharded
    (FSDP2) by then."""
    return Attachment(trainer.strategy.model, list(pl_module.parameters()), data_parallel(trainer)[0])
