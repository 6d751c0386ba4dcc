"""Where the training DataLoader reaches Lightning: SimiGrad swaps its batch sampler, and reads the fit's facts.

Lightning loads the training data through the fit loop's data source. :class:`AdaptiveDataSource` stands in for
it for the length of a fit and hands every DataLoader it loads (the first, a reloaded one, one after a tuner's
trials) to SimiGrad, which returns it drawing from an
:class:`~lightning_simigrad.data.sampler.AdaptiveBatchSampler`. The functions below read what the
Lightning-free :class:`~lightning_simigrad.run.Run` needs to know of the Trainer, once, when the data arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, SequentialSampler

from lightning_simigrad.core.settings import Settings
from lightning_simigrad.data.sampler import AdaptiveBatchSampler, shuffles, with_batch_sampler
from lightning_simigrad.integration import neighbours
from lightning_simigrad.measurement import (
    Measurement,
    MidpointReductionMeasurement,
    RankGroupMeasurement,
    ShardedHalvesMeasurement,
    TwoStageReduceScatterMeasurement,
    WindowHalvesMeasurement,
)
from lightning_simigrad.measurement.sharded_halves import check_sharding
from lightning_simigrad.run import Data, Limits, Run
from lightning_simigrad.state.resume import Restart

__all__ = [
    "AdaptiveDataSource",
    "adaptive_loader",
    "data_of",
    "data_parallel",
    "epoch_being_trained",
    "limits_of",
    "measurement_for",
    "restart_of",
    "start_run",
]


class AdaptiveDataSource(_DataLoaderSource):
    """Lightning's training data source, returning the DataLoader ``adapt`` makes of the user's."""

    def __init__(self, source: _DataLoaderSource, adapt: Callable[[Any], Any]) -> None:
        super().__init__(source.instance, source.name)
        self.original = source
        self._adapt = adapt

    def dataloader(self) -> Any:
        return self._adapt(super().dataloader())

    @staticmethod
    def install(trainer: pl.Trainer, adapt: Callable[[Any], Any]) -> None:
        trainer.fit_loop._data_source = AdaptiveDataSource(trainer.fit_loop._data_source, adapt)

    @staticmethod
    def uninstall(trainer: pl.Trainer) -> None:
        source = trainer.fit_loop._data_source
        if isinstance(source, AdaptiveDataSource):
            trainer.fit_loop._data_source = source.original

    @staticmethod
    def reload(trainer: pl.Trainer) -> None:
        """Make Lightning load the training data again, through this source (after a tuner's trials)."""
        trainer.fit_loop._combined_loader = None


def training_order(trainer: pl.Trainer, loader: DataLoader) -> Any:
    """The sampler whose order an epoch follows: the DataLoader's, or in order under ``overfit_batches``."""
    # `overfit_batches` trains the same first samples every epoch, in order
    if getattr(trainer, "overfit_batches", 0) > 0:
        return SequentialSampler(loader.dataset)  # type: ignore[arg-type]
    return loader.sampler


def data_of(loader: DataLoader, order: Any) -> Data:
    assert loader.batch_size is not None  # checked by `check_dataloader`
    regenerable = shuffles(order) is not None
    return Data(len(order), loader.batch_size, loader.drop_last, regenerable, sampler=type(order).__name__)


def limits_of(trainer: pl.Trainer, setting: Callable[[str], Any]) -> Limits:
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


def restart_of(trainer: pl.Trainer, state: dict[str, Any] | None) -> Restart:
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


def adaptive_loader(loader: DataLoader, order: Any, run: Run) -> DataLoader:
    """``loader`` drawing this rank's micro-batches of the run's windows."""
    assert loader.batch_size is not None
    limit = run.epoch_samples()
    run.schedule.epoch_limit = limit if limit < len(order) else None
    sampler = AdaptiveBatchSampler(order, loader.batch_size, loader.drop_last, schedule=run.schedule, rank=run.rank)
    return with_batch_sampler(loader, sampler)


def start_run(
    trainer: pl.Trainer,
    settings: Settings,
    loader: DataLoader,
    order: Any,
    limits: Limits,
    seed: int,
    restart: Restart | None,
    tuned_from: int | None,
) -> Run:
    """The fit's run, made when its training data first arrives, measuring as the strategy trains.

    B0 is the checkpoint's, or the one given, or the DataLoader's batch (before a ``BatchSizeFinder`` tuned it) x
    world size x ``accumulate_grad_batches``.
    """
    world, rank = data_parallel(trainer)
    state = restart.state if restart is not None and restart.state is not None else {}
    per_device = tuned_from or loader.batch_size
    assert per_device is not None
    b0 = state.get("initial_batch_size") or settings.initial_batch_size
    initial_batch_size = b0 or per_device * world * int(trainer.accumulate_grad_batches)
    return Run(
        settings,
        data_of(loader, order),
        limits,
        world,
        rank,
        seed,
        initial_batch_size,
        epoch=lambda: epoch_being_trained(trainer),
        measurement=measurement_for(trainer),
        restart=restart,
        warn=rank_zero_warn,
        info=rank_zero_info,
    )


def data_parallel(trainer: pl.Trainer) -> tuple[int, int]:
    """The number of data-parallel ranks and this process's rank among them (each feeds its own samples)."""
    if isinstance(trainer.strategy, ModelParallelStrategy):  # tensor-parallel ranks would share their samples
        kwargs = trainer.strategy.distributed_sampler_kwargs
        return int(kwargs["num_replicas"]), int(kwargs["rank"])
    return trainer.world_size, trainer.global_rank


def attach_measurement(
    measurement: Measurement, trainer: pl.Trainer, pl_module: pl.LightningModule, data_parallel_size: int
) -> None:
    """Check the wrapped model the measurement will read, and hook it in where it measures inside a reduction.

    Called when training starts: the strategy has wrapped (FSDP1) or the module sharded (FSDP2) the model by then.
    """
    if isinstance(measurement, RankGroupMeasurement):
        measurement.register(trainer.strategy.model)  # type: ignore[arg-type]
    elif isinstance(measurement, (MidpointReductionMeasurement, TwoStageReduceScatterMeasurement)):
        neighbours.check_fsdp1_units(trainer.strategy.model)  # units the module wrapped itself in too
        if isinstance(measurement, TwoStageReduceScatterMeasurement):
            measurement.register(trainer.strategy.model)
    elif isinstance(measurement, ShardedHalvesMeasurement):
        check_sharding(list(pl_module.parameters()), data_parallel_size)


def measurement_for(trainer: pl.Trainer) -> Measurement:
    """The measurement of a fit as ``trainer`` trains it."""
    if isinstance(trainer.strategy, ModelParallelStrategy):
        return ShardedHalvesMeasurement()
    if isinstance(trainer.strategy, FSDPStrategy):  # FSDP1 keeps each rank's gradient unreduced while accumulating
        # two rank groups inside the reduce-scatter need partners; on an odd number of ranks, a midpoint reduction
        return TwoStageReduceScatterMeasurement() if trainer.world_size % 2 == 0 else MidpointReductionMeasurement()
    return WindowHalvesMeasurement() if trainer.world_size == 1 else RankGroupMeasurement()
