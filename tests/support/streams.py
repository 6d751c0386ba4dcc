"""Streams over :class:`~tests.support.helpers.IndexedRegression` as users write them: a torch ``IterableDataset``
sharded by rank and by worker (torch's docs' recipe), to be read through a plain ``DataLoader`` or torchdata's
``StatefulDataLoader``."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from tests.support.helpers import IndexedRegression


class IndexedStream(IterableDataset):
    """The samples of an :class:`IndexedRegression`, each rank reading every W-th, each of its workers every k-th of
    those; shuffled anew each epoch (``set_epoch``) when ``shuffle``. ``skip_rank`` gives that rank nothing."""

    def __init__(self, dataset: IndexedRegression, shuffle: bool = False, uneven: int = 0) -> None:
        self.dataset, self.shuffle, self.uneven, self.epoch = dataset, shuffle, uneven, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        return torch.randperm(n, generator=torch.Generator().manual_seed(1000 + self.epoch)).tolist()

    def __iter__(self):
        # a DataLoader worker may not see the process group: the launcher's environment says the rank too
        if dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = self.order()[rank::world]
        if self.uneven and rank == world - 1:  # the last rank runs dry early
            mine = mine[: max(0, len(mine) - self.uneven)]
        for i in mine[worker::workers]:
            yield self.dataset[i]


def each_sample_once(samples: list[list[int]], n: int, passes: int) -> None:
    """Every pass over the stream trained each of its ``n`` samples exactly once (steps' samples in order)."""
    flat = [i for step in samples for i in step]
    assert len(flat) == n * passes
    for p in range(passes):
        assert sorted(flat[p * n : (p + 1) * n]) == list(range(n))


class SaveAtStep(pl.Callback):
    """Writes a checkpoint once, after optimizer step ``step``."""

    def __init__(self, path, step: int) -> None:
        self.path, self.step, self.saved = path, step, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not self.saved:
            self.saved = True
            trainer.save_checkpoint(self.path)
