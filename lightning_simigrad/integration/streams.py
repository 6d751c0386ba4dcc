"""Where a stream reaches SimiGrad: a training DataLoader over an ``IterableDataset`` becomes
:class:`~lightning_simigrad.data.stream.StreamWindows`, with the ranks' counts exchanged over ``torch.distributed``
and the loader's position kept in SimiGrad's checkpoint.

What it refuses, before the first step: a micro-batch cap below the loader's batch (a stream's micro-batch is the
loader's batch), and a mid-epoch resume that cannot be exact: a loader without ``state_dict`` (the rest of the
epoch cannot be found; plain Lightning would silently train its first part again), or a checkpoint written on
another number of ranks (each rank's position is its own stream's).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from lightning_simigrad.core.sample_counts import Data
from lightning_simigrad.data.stream import Exchange, StreamWindows
from lightning_simigrad.integration import trainer_facts
from lightning_simigrad.run import Run

__all__ = ["is_stream", "stream_data", "stream_windows"]


def is_stream(loader: DataLoader) -> bool:
    return isinstance(loader.dataset, IterableDataset)


def stream_data(loader: DataLoader, max_micro_batch_size: int | None) -> Data:
    """The stream as a fit sees it: no length (the noise scale reads independent draws), the loader's batch."""
    assert loader.batch_size is not None  # checked by `refusals.check_dataloader`
    if max_micro_batch_size is not None and max_micro_batch_size < loader.batch_size:
        raise ValueError(
            f"A stream's micro-batch is its DataLoader's batch ({loader.batch_size} samples), which is above"
            f" `max_micro_batch_size={max_micro_batch_size}`. Give the DataLoader `batch_size={max_micro_batch_size}`"
            " (SimiGrad accumulates as many as a window needs), or drop `max_micro_batch_size`."
        )
    return Data(None, loader.batch_size, loader.drop_last, sampler=type(loader.dataset).__name__)


def stream_windows(trainer: pl.Trainer, loader: DataLoader, run: Run, state: dict[str, Any] | None) -> StreamWindows:
    """``loader`` re-batched into the run's windows; ``state`` is SimiGrad's checkpoint state being resumed."""
    world, rank = trainer_facts.data_parallel(trainer)
    windows = StreamWindows(loader, run.schedule, rank, world, _exchange(trainer, world, rank))
    resume = run.schedule.resume_from
    if resume is None or resume.epoch != trainer_facts.epoch_being_trained(trainer):
        return windows
    name = f"`{type(loader).__name__}` over `{type(loader.dataset).__name__}`"
    path = str(trainer.ckpt_path) if trainer.ckpt_path else "The checkpoint"
    if not windows.stateful:
        if resume.samples_done > 0:
            raise RuntimeError(
                f"{path} was written {resume.samples_done} samples into epoch {resume.epoch}, and the training"
                f" DataLoader, a {name}, has no `state_dict`: the rest of the epoch cannot be found, and starting it"
                " over would train its first part twice. Use a loader that keeps its position (torchdata's"
                " `StatefulDataLoader`, LitData's `StreamingDataLoader`), or resume from a checkpoint written at the"
                " end of an epoch."
            )
        return windows
    states = (state or {}).get("stream")
    if states is None or len(states) != trainer.world_size:
        written = "no loader positions" if states is None else f"the loader positions of {len(states)} process(es)"
        raise RuntimeError(
            f"{path} was written inside epoch {resume.epoch} and holds {written}; this fit runs"
            f" {trainer.world_size} process(es) over a {name}, whose every rank reads its own part of the stream from"
            " its own position. Resume on the number of processes that wrote it, or from a checkpoint written at the"
            " end of an epoch."
        )
    windows.resume_at(states[trainer.global_rank])
    return windows


def _exchange(trainer: pl.Trainer, world: int, rank: int) -> Exchange:
    """Every data-parallel rank's counts, gathered over all processes (a rank's tensor-parallel replicas draw the
    same batches: the first row of each rank is its)."""

    def exchange(sizes: list[int], dry: bool) -> list[tuple[list[int], bool]]:
        if trainer.world_size == 1:
            return [(sizes, dry)]
        rows: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(rows, (rank, sizes, dry))
        by_rank: dict[int, tuple[list[int], bool]] = {}
        for r, row_sizes, row_dry in rows:
            by_rank.setdefault(r, (row_sizes, row_dry))
        return [by_rank[r] for r in range(world)]

    return exchange
