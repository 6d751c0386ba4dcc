"""The data source for streams: a DataLoader over an ``IterableDataset`` (torch's own, LitData's
``StreamingDataset``, a Hugging Face ``datasets.IterableDataset``), with or without state (torchdata's
``StatefulDataLoader``, LitData's ``StreamingDataLoader``).

A stream has its own order, no length and (with workers) is read in other processes, so windows cannot be planned
over sample positions as :mod:`~lightning_simigrad.data.sampler` plans them. :class:`StreamWindows` re-batches what
arrives instead, in the training process: the loader's own batch, fixed (LitData's resume and worker striping count
on it), is one micro-batch, and a window of ``B`` samples asks every rank for ``m = round(B / (W b))``
micro-batches (at least the measurement's minimum, even where the halves are halves in time). So a stream's window
sizes move in steps of ``W b`` samples.

Every rank draws its ``m`` loader batches, then every rank learns every rank's counts in one gather of a few
integers per window (:data:`Exchange`), so each window's sizes are exact on all ranks before its first micro-batch
trains: every step's gradient is the mean over exactly its samples, however short a worker's last batch is. A rank
whose stream has run dry feeds its last batch again with zero weight while the others finish theirs (every sample
once per pass; under ``drop_last`` the pass ends, for every rank, at the first window a rank cannot fill). A window
that reaches the fit's budget is cut to exactly what is left (its batches sliced).

Resume: before drawing each window the loader's ``state_dict()`` is taken, if it has one; a checkpoint records,
per rank, the position before the first window no optimizer step has averaged (:meth:`StreamWindows.position`),
and the resumed loader starts there, planning the same windows again: the samples drawn ahead but not trained are
drawn again, not lost. A window the fit's budget cut trained only the first samples it drew: the position after it
is the loader's state before it and the samples of it this rank trained, which a resumed rank draws and passes over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_simigrad.core.plan import Window
from lightning_simigrad.data.schedule import EpochPlan, WindowSchedule

__all__ = [
    "Exchange",
    "StreamPosition",
    "StreamWindows",
    "count_samples",
    "drop_first",
    "micro_batches_for",
    "take_first",
]

# every rank's (sizes of the micro-batches it drew, its stream ran dry): one gather per window
Exchange = Callable[[list[int], bool], list[tuple[list[int], bool]]]


def count_samples(batch: Any) -> int:
    """The samples in a collated batch: the length of its first tensor's first dimension (a list's length where it
    holds no tensor).

    >>> count_samples({"input_ids": torch.zeros(3, 8), "labels": torch.zeros(3, 8)}), count_samples([[1, 2], [3, 4]])
    (3, 2)
    """
    tensor = _first_tensor(batch)
    if tensor is not None:
        return int(tensor.shape[0]) if tensor.dim() else 1
    if isinstance(batch, (list, tuple)):
        return len(batch)
    raise TypeError(
        f"SimiGrad counts a stream's samples by the first dimension of the batch's first tensor; this batch is a"
        f" `{type(batch).__name__}` with no tensor. Collate samples into tensors (the DataLoader's `collate_fn`)."
    )


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def take_first(batch: Any, n: int) -> Any:
    """The first ``n`` samples of a collated batch: every tensor (and every list of as many items as the batch has
    samples) cut along its first dimension.

    >>> take_first((torch.arange(4), ["a", "b", "c", "d"]), 2)
    (tensor([0, 1]), ['a', 'b'])
    """
    size = count_samples(batch)
    return _cut(batch, n, size)


def drop_first(batch: Any, n: int) -> Any:
    """A collated batch without its first ``n`` samples (what :func:`take_first` leaves).

    >>> drop_first((torch.arange(4), ["a", "b", "c", "d"]), 3)
    (tensor([3]), ['d'])
    """
    return _cut(batch, slice(n, None), count_samples(batch))


def _cut(value: Any, part: int | slice, size: int) -> Any:
    """``value``'s samples ``[:part]`` (an int) or ``[part]`` (a slice), along every first dimension of ``size``."""
    cut = slice(None, part) if isinstance(part, int) else part
    if isinstance(value, torch.Tensor):
        return value[cut] if value.dim() and value.shape[0] == size else value
    if isinstance(value, Mapping):
        return type(value)({key: _cut(item, part, size) for key, item in value.items()})  # type: ignore[call-arg]
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_cut(item, part, size) for item in value))
    if isinstance(value, (list, tuple)):
        if len(value) == size and not any(isinstance(item, torch.Tensor) for item in value):
            return type(value)(value[cut])
        return type(value)(_cut(item, part, size) for item in value)
    return value


def micro_batches_for(batch_size: int, world_size: int, loader_batch: int, min_micro_batches: int) -> int:
    """Micro-batches per rank of a window asked for ``batch_size`` samples, each a loader batch of ``loader_batch``.

    >>> micro_batches_for(100, world_size=2, loader_batch=8, min_micro_batches=1)  # 6.25 -> 6: 96 samples
    6
    >>> micro_batches_for(100, world_size=1, loader_batch=8, min_micro_batches=2)  # 12.5 -> 13 -> even: 14
    14
    >>> micro_batches_for(5, world_size=1, loader_batch=8, min_micro_batches=2)
    2
    """
    m = max(min_micro_batches, 1, int(batch_size / (world_size * loader_batch) + 0.5))
    return m + 1 if min_micro_batches >= 2 and m % 2 else m


@dataclass(frozen=True)
class StreamPosition:
    """Where a rank's stream resumes: the loader's state, then this rank's first ``skip`` samples passed over (those of
    a window the fit's budget cut, which were trained)."""

    loader_state: Any
    skip: int = 0


@dataclass
class _Drawn:
    """One window as this rank drew it."""

    batches: list[Any]
    dry: bool


class StreamWindows:
    """What Lightning iterates for a stream: this rank's micro-batches of windows re-batched from ``loader``.

    Args:
        loader: the user's training DataLoader over a stream (its ``batch_size`` is one micro-batch).
        schedule: the shared :class:`WindowSchedule` (its ``max_micro_batch_size`` is not used: a micro-batch is a
            loader batch).
        rank, world_size: this rank among the data-parallel ranks.
        exchange: gathers every rank's counts (one call per window, on every rank in the same order).
    """

    def __init__(
        self,
        loader: Any,
        schedule: WindowSchedule,
        rank: int,
        world_size: int,
        exchange: Exchange,
    ) -> None:
        self.loader, self.schedule, self.rank, self.world_size = loader, schedule, rank, world_size
        self.exchange = exchange
        self.batch_size = int(loader.batch_size)
        self.drop_last = bool(getattr(loader, "drop_last", False))
        self.stateful = callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None)
        )
        self._resume: StreamPosition | None = None
        # window index in the epoch -> where the stream stood before it was drawn
        self._positions: dict[int, StreamPosition] = {}

    # Lightning saves and restores a loader that has these before making its iterator, and then does not warn that
    # a mid-epoch resume restarts it: SimiGrad records the position itself (`position`)
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def resume_at(self, position: StreamPosition) -> None:
        """Start the first epoch iterated where a checkpoint recorded this rank's stream: inside the resumed epoch
        (``schedule.resume_from``), or at the end of the epoch before (so that the loader counts its epochs on)."""
        self._resume = position

    def position(self) -> StreamPosition | None:
        """Where this rank's stream stood before the first window of the epoch no optimizer step has averaged (None:
        the loader has no state, or nothing was drawn yet)."""
        return self._positions.get(self.schedule.current.first_pending)

    def __iter__(self) -> Iterator[Any]:
        schedule, plan_epoch = self.schedule, self.schedule.epoch()
        resume = schedule.resume_from
        position, replay = 0, []
        resumed_at, self._resume = self._resume, None  # the first epoch iterated; a later one goes on from here
        inside = resume is not None and resume.epoch == plan_epoch
        if resume is not None and inside:
            position, replay = resume.samples_done, list(resume.planned)
        if resumed_at is not None:
            self.loader.load_state_dict(resumed_at.loader_state)
        skip = resumed_at.skip if resumed_at is not None and inside else 0
        before_epoch = schedule.trained() - position
        # the fit's budget cuts the window that reaches it; windows after it are drawn but never trained (the run
        # stops the fit), so the epoch does not look finished to Lightning, as with any stop inside an epoch
        budget = schedule.samples_left()
        plan = EpochPlan(plan_epoch, end=position, planned=position)
        schedule.current, self._positions = plan, {}
        if resumed_at is not None and inside and self.stateful:  # the first window's position is the checkpoint's
            self._positions[0] = resumed_at
        batches = _passing_over(iter(self.loader), skip)
        last: Any = None  # this rank's last batch: what it feeds, weighed by zero, when it has none
        dry = False
        while True:
            requested = replay.pop(0) if replay else schedule.requested(before_epoch + position)
            m = micro_batches_for(requested, self.world_size, self.batch_size, schedule.min_micro_batches)
            before: StreamPosition | None = None
            if self.stateful:  # the position a checkpoint written before this window trains records
                for index in [i for i in self._positions if i < plan.first_pending]:
                    del self._positions[index]
                before = self._positions.setdefault(plan.planned_windows, StreamPosition(self.loader.state_dict()))
            drawn = _Drawn([], dry)
            while not drawn.dry and len(drawn.batches) < m:
                try:
                    drawn.batches.append(next(batches))
                except StopIteration:
                    drawn.dry = True
            dry = drawn.dry
            window, batches_fed, cut = self._window(drawn, m, budget)
            if window is None:
                plan.last_window, plan.ends_epoch = plan.planned_windows - 1, True
                if self.stateful:  # the pass is over: a checkpoint at the epoch's end records the loader's end
                    self._positions[plan.planned_windows] = StreamPosition(self.loader.state_dict())
                return
            if before is not None and cut:
                # cut by the budget: what this rank drew past its share is trained after a resume, not lost
                taken = before.skip + sum(micro[self.rank] for micro in window.sizes)
                self._positions[plan.planned_windows + 1] = StreamPosition(before.loader_state, taken)
            budget -= window.total
            plan.append(window, requested)
            plan.planned = plan.end = position + window.total
            position += window.total
            for j in range(window.num_micro_batches):
                if window.sizes[j][self.rank]:
                    last = batches_fed[j]
                    yield last
                elif last is not None:
                    yield last  # a zero-weight sample: every rank steps
                else:
                    raise RuntimeError(
                        f"Rank {self.rank}'s training stream yielded no sample in epoch {plan_epoch} while other"
                        " ranks' did, so it has nothing to step with. Give every rank a share of the stream (shard it"
                        " by rank with as many shards as ranks, or LitData's `StreamingDataset`, which does)."
                    )

    def _window(self, drawn: _Drawn, m: int, budget: float) -> tuple[Window | None, list[Any], bool]:
        """The window every rank agrees on from what each drew (None: the pass ends), this rank's batches, and whether
        the fit's budget cut it short of what was drawn."""
        sizes = [count_samples(batch) for batch in drawn.batches]
        rows = self.exchange(sizes + [0] * (m - len(sizes)), drawn.dry)
        if len(rows) != self.world_size or any(len(row) != m for row, _ in rows):
            raise RuntimeError(
                "The ranks planned windows of different numbers of micro-batches from their streams; this is a bug"
                " in lightning_simigrad (every rank plans from the same decision)."
            )
        if self.drop_last and any(row_dry for _, row_dry in rows):
            return None, [], False  # a rank could not fill its share: the tail is dropped on every rank
        grid = [[rows[r][0][j] for r in range(self.world_size)] for j in range(m)]
        kept = [j for j in range(m) if any(grid[j])]
        if not kept:
            return None, [], False
        grid = [grid[j] for j in kept]
        batches = [drawn.batches[j] if j < len(drawn.batches) else None for j in kept]
        total = sum(map(sum, grid))
        cut = 0 < budget < total
        if cut:  # the fit's last window: exactly what is left, in slot order
            grid, batches = _cut_to(grid, batches, int(max(budget, 1)), self.rank)
        return Window(tuple(tuple(micro) for micro in grid)), batches, cut


def _passing_over(batches: Iterator[Any], skip: int) -> Iterator[Any]:
    """``batches`` without their first ``skip`` samples (the last batch they fall in cut)."""
    for batch in batches:
        if skip:
            size = count_samples(batch)
            if skip >= size:
                skip -= size
                continue
            batch, skip = drop_first(batch, skip), 0
        yield batch


def _cut_to(grid: list[list[int]], batches: list[Any], budget: int, rank: int) -> tuple[list[list[int]], list[Any]]:
    """The first ``budget`` samples of a window, slots laid out micro-major, ranks in order; this rank's batches cut
    to its slots."""
    left, cut_grid, cut_batches = budget, [], []
    for micro, batch in zip(grid, batches, strict=True):
        if left <= 0:
            break
        row = []
        for size in micro:
            row.append(min(size, left))
            left -= row[-1]
        mine = row[rank]
        cut_grid.append(row)
        cut_batches.append(take_first(batch, mine) if batch is not None and 0 < mine < micro[rank] else batch)
    return cut_grid, cut_batches
