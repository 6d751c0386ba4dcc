"""The batch sampler that hands each rank its micro-batches of map-style data.

:class:`AdaptiveBatchSampler` replaces the training DataLoader's batch sampler. It walks the epoch's order
(:class:`~lightning_simigrad.data.order.EpochOrder`, the same on every rank) window by window as
:func:`~lightning_simigrad.data.windows.walk_epoch` plans them, and yields this rank's slots of each window, so
every sample is fed exactly once per epoch with no padding, unlike ``DistributedSampler``. A DataLoader's batch
sampler runs in the main process even with workers, so the windows it plans are recorded in the
:class:`~lightning_simigrad.data.schedule.WindowSchedule` the run reads back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler

from lightning_simigrad.data.order import EpochOrder, shuffles
from lightning_simigrad.data.schedule import WindowSchedule
from lightning_simigrad.data.windows import walk_epoch

__all__ = ["AdaptiveBatchSampler", "with_batch_sampler"]


class AdaptiveBatchSampler(BatchSampler):
    """Yields this rank's micro-batches of windows planned from the schedule's current batch size.

    Args:
        sampler: the index order to follow: a ``SequentialSampler``, a ``RandomSampler`` (shuffled with
            the schedule's seed, so that all ranks and a resumed run agree), a ``DistributedSampler``
            (its dataset, shuffle flag and seed are used; the sharding is done here), or any other
            sampler of a single process, whose order is taken as it comes.
        batch_size: the DataLoader's batch size (kept for Lightning's re-instantiation; the windows
            are sized by the schedule).
        drop_last: drop the epoch's tail when it is smaller than the window the schedule asks for.
        schedule: the shared :class:`WindowSchedule`.
        rank: this process's global rank.
    """

    def __init__(
        self,
        sampler: Sampler[int] | list[int],
        batch_size: int,
        drop_last: bool,
        schedule: WindowSchedule | None = None,
        rank: int = 0,
    ) -> None:
        super().__init__(sampler, batch_size, drop_last)
        if schedule is None:
            raise ValueError("`AdaptiveBatchSampler` needs the `schedule` it shares with the SimiGrad callback.")
        self.schedule = schedule
        self.rank = rank
        if isinstance(sampler, DistributedSampler):
            # Lightning injects one under DDP; we keep its settings and shard ourselves without padding
            self.rank = sampler.rank
        if schedule.world_size > 1 and shuffles(sampler) is None:
            raise ValueError(
                f"SimiGrad shards samples across ranks itself, walking one order that every rank can regenerate: a"
                f" RandomSampler without replacement or a SequentialSampler, not this `{type(sampler).__name__}`."
                f" Use `shuffle=True` or `shuffle=False` in the DataLoader."
            )

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The global index order of an epoch: identical on every rank, and again after a resume."""
        return EpochOrder(self.sampler, self.schedule.seed).epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.schedule.epoch()
        order = self.epoch_order(epoch)
        weights = self.schedule.weights_in(order)
        for window, start in walk_epoch(self.schedule, epoch, len(order), self.drop_last, weights):
            for j in range(window.num_micro_batches):
                size = window.sizes[j][self.rank]
                if not size:
                    # a rank left without samples in a tiny window still steps: it feeds one sample the run weighs by
                    # zero (one of the window's own samples, alone in its slot: within any token bound)
                    yield [int(order[start + (window.order[-1] if window.order else 0)])]
                    continue
                positions = window.slot_positions(j, self.rank)
                if isinstance(positions, range):
                    # the DataLoader's fetcher indexes the dataset with each item: plain ints, as a sampler's
                    yield order[start + positions.start : start + positions.stop].tolist()
                else:
                    yield order[start + torch.tensor(positions, dtype=torch.int64)].tolist()

    def __len__(self) -> int:
        # The number of micro-batches in an epoch depends on decisions not taken yet. Lightning reads a
        # length as a promise (it ends the epoch when that many batches were fetched), so there is none:
        # Lightning then finds the epoch's end by fetching one batch ahead.
        raise TypeError("an adaptive batch sampler has no length: its epoch's micro-batch count is decided as it goes")


class _ResumableDataLoader(DataLoader):
    """A DataLoader that tells Lightning it resumes mid-epoch: its sampler restarts from the position
    SimiGrad checkpoints (``WindowSchedule.resume_from``), so the loader itself has no state to save."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def with_batch_sampler(loader: DataLoader, batch_sampler: BatchSampler) -> DataLoader:
    """A DataLoader like ``loader`` (workers, collation, pinning, ...) that draws from ``batch_sampler``."""
    return _ResumableDataLoader(
        loader.dataset,
        batch_sampler=batch_sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
    )
