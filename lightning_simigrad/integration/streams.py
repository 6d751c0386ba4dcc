"""Where a stream reaches SimiGrad: a training DataLoader over an ``IterableDataset`` becomes
:class:`~lightning_simigrad.data.stream.StreamWindows`, with the ranks' counts gathered through
:mod:`lightning_simigrad.exchange` and the loader's position kept in SimiGrad's checkpoint.

What it refuses, before the first step: a micro-batch cap below the loader's batch (a stream's micro-batch is the
loader's batch), and a mid-epoch resume that cannot be exact: a loader without ``state_dict`` (the rest of the
epoch cannot be found; plain Lightning would silently train its first part again), or a checkpoint written on
another number of ranks (each rank's position is its own stream's).
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset

from lightning_simigrad.core.sample_counts import Data
from lightning_simigrad.core.settings import Settings
from lightning_simigrad.data.stream import GatherCounts, StreamPosition, StreamWindows, micro_batches_for
from lightning_simigrad.exchange import gather_objects
from lightning_simigrad.integration import refusals, trainer_facts
from lightning_simigrad.run import Run
from lightning_simigrad.state.resume import Restart

__all__ = ["StreamSource", "is_stream", "rounding"]


def is_stream(loader: DataLoader) -> bool:
    return isinstance(loader.dataset, IterableDataset)


class StreamSource:
    """A stream: re-batched into the run's windows as it arrives, its epochs' lengths unknown, every rank's position
    in it kept in the checkpoint where its loader keeps one (see the module docstring for what is refused).

    Args:
        trainer: the fit's Trainer.
        loader: the user's training DataLoader over a stream (its ``batch_size`` is one micro-batch).
        settings: the callback's settings.
    """

    sized = False

    def __init__(self, trainer: pl.Trainer, loader: DataLoader, settings: Settings) -> None:
        refusals.refuse_weights_over_a_stream(settings.batch_unit)
        assert loader.batch_size is not None  # checked by `refusals.check_dataloader`
        cap = settings.max_micro_batch_size
        if cap is not None and cap < loader.batch_size:
            raise ValueError(
                f"A stream's micro-batch is its DataLoader's batch ({loader.batch_size} samples), which is above"
                f" `max_micro_batch_size={cap}`. Give the DataLoader `batch_size={cap}` (SimiGrad accumulates as many"
                " as a window needs), or drop `max_micro_batch_size`."
            )
        self.trainer, self.loader = trainer, loader
        # no length: the noise scale reads independent draws
        self.data = Data(None, loader.batch_size, loader.drop_last, sampler=type(loader.dataset).__name__)
        self.windows: StreamWindows | None = None

    @property
    def keeps_position(self) -> bool:
        return self.windows is not None and self.windows.stateful

    def position(self) -> StreamPosition | None:
        return self.windows.position() if self.windows is not None else None

    def adapt(self, run: Run, restart: Restart | None) -> StreamWindows:
        """The loader re-batched into the run's windows, resumed where ``restart``'s checkpoint left every rank."""
        trainer = self.trainer
        world, rank = trainer_facts.data_parallel(trainer)
        windows = StreamWindows(self.loader, run.schedule, rank, world, _gather_counts(world, rank))
        self.windows = windows
        rounded = rounding(run, world, windows.batch_size)
        if rounded is not None:
            rank_zero_warn(rounded)
        resume = run.schedule.resume_from
        if resume is None or restart is None or restart.state is None:
            return windows
        positions = restart.saved.streams
        if resume.epoch != run.epoch():
            # written at the end of the epoch before: the loader goes on from its end, counting its epochs (LitData
            # shuffles each by its number), as the uninterrupted run's did; on another number of ranks it starts afresh
            if restart.at_epoch_end and positions is not None and len(positions) == trainer.world_size:
                at_end = positions[trainer.global_rank]
                if windows.stateful and at_end is not None:
                    windows.resume_at(StreamPosition(at_end.loader_state))
            return windows
        self._refuse_what_cannot_resume(resume.epoch, resume.samples_done, positions)
        mine = positions[trainer.global_rank] if positions is not None else None
        if windows.stateful and mine is not None:
            windows.resume_at(mine)
        return windows

    def _refuse_what_cannot_resume(self, epoch: int, done: int, positions: list[StreamPosition | None] | None) -> None:
        """A mid-epoch resume of a loader without a position, or of positions of another number of ranks."""
        trainer, loader = self.trainer, self.loader
        name = f"`{type(loader).__name__}` over `{type(loader.dataset).__name__}`"
        path = str(trainer.ckpt_path) if trainer.ckpt_path else "The checkpoint"
        assert self.windows is not None
        if not self.windows.stateful:
            if done > 0:
                raise RuntimeError(
                    f"{path} was written {done} samples into epoch {epoch}, and the training DataLoader, a {name}, has"
                    " no `state_dict`: the rest of the epoch cannot be found, and starting it over would train its"
                    " first part twice. Use a loader that keeps its position (torchdata's `StatefulDataLoader`,"
                    " LitData's `StreamingDataLoader`), or resume from a checkpoint written at the end of an epoch."
                )
            return
        if positions is None or len(positions) != trainer.world_size:
            written = (
                "no loader positions" if positions is None else f"the loader positions of {len(positions)} process(es)"
            )
            raise RuntimeError(
                f"{path} was written inside epoch {epoch} and holds {written}; this fit runs {trainer.world_size}"
                f" process(es) over a {name}, whose every rank reads its own part of the stream from its own position."
                " Resume on the number of processes that wrote it, or from a checkpoint written at the end of an epoch."
            )


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


def _gather_counts(world: int, rank: int) -> GatherCounts:
    """Every data-parallel rank's counts, gathered over all processes (a rank's tensor-parallel replicas draw the
    same batches: the first row of each rank is its)."""

    def gather(sizes: list[int], dry: bool) -> list[tuple[list[int], bool]]:
        by_rank: dict[int, tuple[list[int], bool]] = {}
        for r, row_sizes, row_dry in gather_objects((rank, sizes, dry)):
            by_rank.setdefault(r, (row_sizes, row_dry))
        return [by_rank[r] for r in range(world)]

    return gather
