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
integers per window (:data:`GatherCounts`), so each window's sizes are exact on all ranks before its first micro-batch
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

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_simigrad.core.plan import Window
from lightning_simigrad.data.planner import EpochPlanner
from lightning_simigrad.data.schedule import EpochPlan, WindowSchedule

__all__ = [
    "GatherCounts",
    "StreamPosition",
    "StreamWindows",
    "count_samples",
    "drop_first",
    "micro_batches_for",
    "take_first",
]

# every rank's (sizes of the micro-batches it drew, its stream ran dry): one gather per window
GatherCounts = Callable[[list[int], bool], list[tuple[list[int], bool]]]


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
        gather_counts: gathers every rank's counts (one call per window, on every rank in the same order).
    """

    def __init__(
        self,
        loader: Any,
        schedule: WindowSchedule,
        rank: int,
        world_size: int,
        gather_counts: GatherCounts,
    ) -> None:
        self.loader, self.schedule, self.rank, self.world_size = loader, schedule, rank, world_size
        self.gather_counts = gather_counts
        self.batch_size = int(loader.batch_size)
        self.drop_last = bool(getattr(loader, "drop_last", False))
        self.stateful = callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None)
        )
        self._resume: StreamPosition | None = None
        self._book: _Book | None = None  # the epoch's positions, for a stateful loader

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
        return self._book.at.get(self.schedule.current.first_pending) if self._book is not None else None

    def __iter__(self) -> Iterator[Any]:
        schedule = self.schedule
        planner = EpochPlanner(schedule, schedule.epoch())
        resumed_at, self._resume = self._resume, None  # the first epoch iterated; a later one goes on from here
        if resumed_at is not None:
            self.loader.load_state_dict(resumed_at.loader_state)
        inside = resumed_at if planner.resumed else None  # a position inside this epoch: its first window starts there
        self._book = book = _Book(self.loader, inside) if self.stateful else None
        batches = _passing_over(iter(self.loader), inside.skip if inside is not None else 0)
        last: Any = None  # this rank's last batch: what it feeds, weighed by zero, when it has none
        dry = False
        while True:
            requested = planner.asked()
            m = micro_batches_for(requested, self.world_size, self.batch_size, schedule.min_micro_batches)
            before = book.before(planner.plan) if book is not None else None
            drawn = _draw(batches, m, dry, book)
            dry = drawn.dry
            window, batches_fed, cut = self._window(drawn, m, planner.budget)
            if window is None:
                planner.finish()
                if book is not None:  # the pass is over: a checkpoint at the epoch's end records the loader's end
                    book.ended(planner.plan.planned_windows)
                return
            if book is not None and before is not None and cut:  # what this rank drew past its share trains later
                book.cut(planner.plan.planned_windows + 1, before, sum(micro[self.rank] for micro in window.sizes))
            planner.record(window, requested)
            for j in range(window.num_micro_batches):
                last = self._hand_out(window, j, batches_fed, last, planner.plan.epoch)
                yield last

    def _hand_out(self, window: Window, j: int, batches: list[Any], last: Any, epoch: int) -> Any:
        """This rank's batch of micro-batch ``j``; where it has none, its last batch again, which the run weighs by
        zero (every rank steps)."""
        if window.sizes[j][self.rank]:
            return batches[j]
        if last is not None:
            return last
        raise RuntimeError(
            f"Rank {self.rank}'s training stream yielded no sample in epoch {epoch} while other ranks' did, so it has"
            " nothing to step with. Give every rank a share of the stream (shard it by rank with as many shards as"
            " ranks, or LitData's `StreamingDataset`, which does)."
        )

    def _window(self, drawn: _Drawn, m: int, budget: float) -> tuple[Window | None, list[Any], bool]:
        """The window every rank agrees on from what each drew (None: the pass ends), this rank's batches, and whether
        the fit's budget cut it short of what was drawn."""
        sizes = [count_samples(batch) for batch in drawn.batches]
        rows = self.gather_counts(sizes + [0] * (m - len(sizes)), drawn.dry)
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


def _draw(batches: Iterator[Any], m: int, dry: bool, book: _Book | None) -> _Drawn:
    """Up to ``m`` of this rank's loader batches (fewer where its stream runs dry)."""
    drawn = _Drawn([], dry)
    while not drawn.dry and len(drawn.batches) < m:
        try:
            drawn.batches.append(next(batches))
        except StopIteration:
            drawn.dry = True
    if book is not None:
        book.drew(sum(count_samples(batch) for batch in drawn.batches))
    return drawn


class _Book:
    """Where this rank's stream stood before each window of the epoch: the loader's last snapshot and the samples drawn
    since it, which a resumed rank draws again and passes over.

    A loader's ``state_dict()`` can cost as much as a window's training (LitData builds it from every worker's state),
    so a snapshot is taken before a window only once the time since the last one is :data:`SNAPSHOT_EVERY` times what
    that one took: the snapshots cost about 1% of the time, and a resume passes over at most the samples drawn since.
    """

    def __init__(self, loader: Any, start: StreamPosition | None) -> None:
        self.loader = loader
        self.snapshot: Any = start.loader_state if start is not None else None  # None: none taken yet
        self.since = start.skip if start is not None else 0  # this rank's samples drawn since the snapshot
        # a resumed position stands until the first draw has passed over its samples (the loader's state before
        # that would leave them out)
        self.may_refresh = start is None
        self.at: dict[int, StreamPosition] = {}  # window index in the epoch -> where the stream stood before it
        self.taken_at, self.cost = 0.0, 0.0

    def before(self, plan: EpochPlan) -> StreamPosition:
        """The position before the next window (``plan.planned_windows``); positions of windows trained are dropped."""
        for index in [i for i in self.at if i < plan.first_pending]:
            del self.at[index]
        now = time.perf_counter()
        if self.snapshot is None or (self.may_refresh and now - self.taken_at >= SNAPSHOT_EVERY * self.cost):
            self.snapshot, self.since = self.loader.state_dict(), 0
            self.taken_at = time.perf_counter()
            self.cost = self.taken_at - now
        return self.at.setdefault(plan.planned_windows, StreamPosition(self.snapshot, self.since))

    def drew(self, samples: int) -> None:
        self.since += samples
        self.may_refresh = True

    def cut(self, index: int, before: StreamPosition, taken: int) -> None:
        """Window ``index - 1``, drawn from ``before``, was cut by the fit's budget after this rank's ``taken``
        samples: window ``index`` starts there."""
        self.at[index] = StreamPosition(before.loader_state, before.skip + taken)

    def ended(self, index: int) -> None:
        """The pass ended before window ``index``: its position is the loader's end."""
        self.at[index] = StreamPosition(self.loader.state_dict())


SNAPSHOT_EVERY = 100  # a loader snapshot once the time since the last is this many times what it took (~1%)


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
