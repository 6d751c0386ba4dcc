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
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset

from lightning_simigrad.core.sample_counts import Data
from lightning_simigrad.data.stream import Exchange, StreamPosition, StreamWindows, micro_batches_for
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


def stream_windows(
    trainer: pl.Trainer, loader: DataLoader, run: Run, state: dict[str, Any] | None, at_epoch_end: bool = False
) -> StreamWindows:
    """``loader`` re-batched into the run's windows; ``state`` is SimiGrad's checkpoint state being resumed, written
    at an epoch's end when ``at_epoch_end``."""
    world, rank = trainer_facts.data_parallel(trainer)
    windows = StreamWindows(loader, run.schedule, rank, world, _exchange(trainer, world, rank))
    rounded = rounding(run, world, windows.batch_size)
    if rounded is not None:
        rank_zero_warn(rounded)
    resume = run.schedule.resume_from
    if resume is None:
        return windows
    states, skips = (state or {}).get("stream"), (state or {}).get("stream_skip")
    if resume.epoch != run.epoch():
        # written at the end of the epoch before: the loader goes on from its end, counting its epochs (LitData
        # shuffles each by its number), as the uninterrupted run's did; on another number of ranks it starts afresh
        if at_epoch_end and states is not None and len(states) == trainer.world_size and windows.stateful:
            windows.resume_at(StreamPosition(states[trainer.global_rank]))
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
    if states is None or len(states) != trainer.world_size:
        written = "no loader positions" if states is None else f"the loader positions of {len(states)} process(es)"
        raise RuntimeError(
            f"{path} was written inside epoch {resume.epoch} and holds {written}; this fit runs"
            f" {trainer.world_size} process(es) over a {name}, whose every rank reads its own part of the stream from"
            " its own position. Resume on the number of processes that wrote it, or from a checkpoint written at the"
            " end of an epoch."
        )
    skip = skips[trainer.global_rank] if skips is not None else 0
    windows.resume_at(StreamPosition(states[trainer.global_rank], skip))
    return windows


def rounding(run: Run, world: int, loader_batch: int) -> str | None:
    """What a stream's whole loader batches make of B0 and the batch-size bounds, in words (None: nothing moves)."""
    minimum = run.schedule.min_micro_batches
    asked = {
        "B0": run.b0,
        "`min_batch_size`": run.settings.min_batch_size,
        "`max_batch_size`": run.settings.max_batch_size,
    }
    moved = []
    for name, size in asked.items():
        used = world * loader_batch * micro_batches_for(size, world, loader_batch, minimum) if size else None
        if used is not None and used != size:
            moved.append(f"{name} = {size} is trained as windows of {used}")
    if not moved:
        return None
    least = f", at least {minimum} a rank for the two halves" if minimum > 1 else ""
    return (
        f"A stream's windows are whole loader batches ({loader_batch} samples on each of {world} rank(s){least}), so"
        f" batch sizes move in steps of {world * loader_batch}: {'; '.join(moved)}. Give the DataLoader a smaller"
        " `batch_size` for finer steps."
    )


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
