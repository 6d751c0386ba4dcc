"""Where the training DataLoader reaches Lightning: SimiGrad hands it back drawing adaptive windows.

Lightning loads the training data through the fit loop's data source. :class:`AdaptiveDataSource` stands in for
it for the length of a fit and hands every DataLoader it loads (the first, a reloaded one, one after a tuner's
trials) to the fit's session, which returns it drawing from an
:class:`~lightning_simigrad.data.sampler.AdaptiveBatchSampler` (:func:`adaptive_loader`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
from torch.utils.data import DataLoader

from lightning_simigrad.data.sampler import AdaptiveBatchSampler, with_batch_sampler
from lightning_simigrad.data.schedule import WindowSchedule

__all__ = ["AdaptiveDataSource", "adaptive_loader"]


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


def adaptive_loader(
    loader: DataLoader, order: Any, schedule: WindowSchedule, epoch_limit: int | None, rank: int
) -> DataLoader:
    """``loader`` drawing this rank's micro-batches of the schedule's windows; ``epoch_limit`` cuts every epoch."""
    assert loader.batch_size is not None
    schedule.epoch_limit = epoch_limit if epoch_limit is not None and epoch_limit < len(order) else None
    sampler = AdaptiveBatchSampler(order, loader.batch_size, loader.drop_last, schedule=schedule, rank=rank)
    return with_batch_sampler(loader, sampler)
