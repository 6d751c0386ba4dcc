"""Where the training data reaches SimiGrad: the source an epoch's samples come from, chosen in one place.

Lightning loads the training data through the fit loop's data source. :class:`AdaptiveDataSource` stands in for
it for the length of a fit and hands every DataLoader it loads (the first, a reloaded one, one after a tuner's
trials) to the fit's session, which asks :func:`source_for` -- the one place a source is chosen -- for the
:class:`Source` it is:

- :class:`MapSource`: a map-style dataset, whose positions are known ahead; it is handed back drawing from an
  :class:`~lightning_simigrad.data.sampler.AdaptiveBatchSampler`, its epochs' lengths known;
- :class:`~lightning_simigrad.integration.streams.StreamSource`: a stream (an ``IterableDataset``), re-batched into
  windows as it arrives (:class:`~lightning_simigrad.data.stream.StreamWindows`), its epochs' lengths unknown, and
  every rank's position in it kept in the checkpoint where its loader keeps one.

The session, the checkpoint and the run ask a source what they need and never which kind it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import lightning.pytorch as pl
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
from torch.utils.data import DataLoader

from lightning_simigrad.core.sample_counts import Data
from lightning_simigrad.core.settings import Settings
from lightning_simigrad.data.sampler import AdaptiveBatchSampler, with_batch_sampler
from lightning_simigrad.data.schedule import WindowSchedule
from lightning_simigrad.data.stream import StreamPosition
from lightning_simigrad.data.weights import sample_weights
from lightning_simigrad.integration import streams, trainer_facts
from lightning_simigrad.run import Run
from lightning_simigrad.state.resume import Restart

__all__ = ["AdaptiveDataSource", "MapSource", "Source", "WeightsRead", "adaptive_loader", "source_for"]


class Source(Protocol):
    """Where an epoch's samples come from, as a fit sees it."""

    data: Data  # the training data's facts: its epoch's length (None: unknown), the loader's batch, samples' weights
    sized: bool  # its epochs' lengths are known ahead (Lightning's bars then get a total: `EpochLength`)

    @property
    def keeps_position(self) -> bool:
        """Its position is every rank's own, and a checkpoint must keep it (:meth:`position`)."""

    def adapt(self, run: Run, restart: Restart | None) -> Any:
        """What Lightning iterates: the source drawing the run's windows, resumed where ``restart`` says."""

    def position(self) -> StreamPosition | None:
        """Where this rank's source resumes, for a checkpoint written now (where :attr:`keeps_position`)."""


class WeightsRead:
    """Every sample's weight in the unit, read once per dataset however often the data is loaded."""

    def __init__(self) -> None:
        self._read: tuple[Any, Any] | None = None

    def of(self, settings: Settings, dataset: Any) -> Any:
        if self._read is None or self._read[0] is not dataset:
            self._read = (dataset, sample_weights(settings.batch_unit, dataset))
        return self._read[1]


class MapSource:
    """A map-style dataset: positions known ahead, an order every rank regenerates, drawn by the adaptive sampler."""

    sized, keeps_position = True, False

    def __init__(self, loader: DataLoader, order: Any, settings: Settings, weights: WeightsRead) -> None:
        """``order``: the sampler an epoch follows (the loader's, unless the training loop trains another)."""
        self.loader, self.order = loader, order
        data = trainer_facts.data_of(loader, self.order)
        read = weights.of(settings, loader.dataset)
        self.data = data if read is None else replace(data, weights=read, weight=int(read.sum()))

    def adapt(self, run: Run, restart: Restart | None) -> Any:
        return adaptive_loader(self.loader, self.order, run.schedule, run.bounds.epoch_samples(), run.rank)

    def position(self) -> StreamPosition | None:
        return None  # the run's counts say where the epoch stands


def source_for(trainer: pl.Trainer, loader: DataLoader, settings: Settings, weights: WeightsRead) -> Source:
    """The source the training DataLoader is: a stream (an ``IterableDataset``), else a map-style dataset."""
    if streams.is_stream(loader):
        return streams.StreamSource(trainer, loader, settings)
    return MapSource(loader, trainer_facts.training_order(trainer, loader), settings, weights)


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
