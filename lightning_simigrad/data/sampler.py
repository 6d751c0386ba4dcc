"""The batch sampler that feeds adaptive windows, and the schedule it shares with the callback.

:class:`AdaptiveBatchSampler` replaces the training DataLoader's batch sampler. Each time it starts a
window it reads the batch size the controller currently asks for, plans the window
(:func:`~lightning_simigrad.core.plan.plan_window`) and yields this rank's micro-batches of it. Because a
DataLoader with workers draws index batches several micro-batches ahead of training, the sampler --
not the callback -- is the authority on window boundaries: it records every window it plans in the
:class:`WindowSchedule`, and the callback reads back, micro-batch by micro-batch, which window and
slot the batch it is training on belongs to. A decision therefore takes effect at the next window
the sampler starts, and every step still knows exactly which samples it averages.

On several ranks all of them walk the same global order (a permutation seeded identically on every
rank) and each takes its slots of each window, so every sample is fed exactly once per epoch with no
padding, unlike ``DistributedSampler``.

Two bounds cut windows, both counted in samples: ``epoch_limit`` (Lightning's ``limit_train_batches``,
converted by the callback) ends the epoch, and the fit's remaining sample budget (``max_steps`` in steps
of B0, or ``max_samples``) ends the window that reaches it. Either way the window is planned to exactly
what is left, as an epoch tail is, so no window is ever cut short by the training loop.

Because windows are planned ahead of training, the batch size a window was planned with is a decision
taken one or more steps before the window trains. A checkpoint therefore records, beside the
controller, the batch sizes of the windows already planned but not yet committed by an optimizer step
(:attr:`EpochPlan.pending`); a resumed sampler plans those again first (:class:`ResumePoint`), so the
resumed run trains the windows the uninterrupted run trained.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from lightning_simigrad.core.plan import Window, plan_window

__all__ = ["AdaptiveBatchSampler", "EpochPlan", "ResumePoint", "WindowSchedule", "shuffles", "with_batch_sampler"]


@dataclass
class EpochPlan:
    """The windows one epoch's iterator has planned and training has not finished, with the training cursor.

    ``windows[0]`` is the window being trained; windows are dropped once training moves past them, so the
    plan holds only the few windows the DataLoader has drawn ahead (its memory does not grow with the epoch).
    ``requests[i]`` is the batch size ``windows[i]`` was planned with.

    ``end`` is the sample position where the epoch's training stops (the data's end, a limit, or the fit's
    budget) and ``planned`` how far windows are planned; once a window reaches ``end``, ``last_window``
    is its index among all the epoch's windows and ``ends_epoch`` tells whether that is the data's end
    rather than a stop.
    """

    epoch: int = 0
    windows: deque[Window] = field(default_factory=deque)
    requests: deque[int] = field(default_factory=deque)
    end: int = 0
    planned: int = 0
    last_window: int | None = None
    ends_epoch: bool = False
    _micro: int = -1
    _committed: bool = False  # an optimizer step has averaged windows[0]
    _dropped: int = 0  # windows training has finished (their index is how many came before)

    @property
    def planned_windows(self) -> int:
        """Windows planned in this epoch so far, trained or not."""
        return self._dropped + len(self.windows)

    def append(self, window: Window, requested: int) -> None:
        self.windows.append(window)
        self.requests.append(requested)

    def next_micro_batch(self) -> tuple[Window, int]:
        """Advance to the next micro-batch the trainer receives; returns its window and index in it."""
        self._micro += 1
        if self._micro >= self.windows[0].num_micro_batches:
            self.windows.popleft()
            self.requests.popleft()
            self._dropped += 1
            self._micro = 0
            self._committed = False
        return self.windows[0], self._micro

    def commit(self) -> None:
        """The optimizer step averaging the window being trained has run."""
        self._committed = True

    @property
    def inside_window(self) -> bool:
        """Training has started a window that no optimizer step has averaged yet."""
        return self._micro >= 0 and not self._committed

    @property
    def pending(self) -> list[int]:
        """Batch sizes of the planned windows no optimizer step has averaged yet, in order."""
        requests = list(self.requests)
        started = self._micro >= 0
        return requests[1:] if started and self._committed else requests

    def micro_batches_left(self) -> tuple[int, bool]:
        """Micro-batches the epoch trains after the current one, and whether the count is exact.

        Planned windows count exactly; samples not planned yet count at the last planned window's
        micro-batch size.
        """
        last = (self.last_window if self.last_window is not None else self.planned_windows - 1) - self._dropped
        left = sum(w.num_micro_batches for w in itertools.islice(self.windows, 0, last + 1)) - (self._micro + 1)
        if self.last_window is None and self.end > self.planned:
            window = self.windows[-1]
            left += math.ceil((self.end - self.planned) * window.num_micro_batches / window.total)
        return left, self.last_window is not None


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run picks up an epoch.

    Args:
        epoch: the epoch the run was training.
        samples_done: samples of that epoch's committed windows (the sampler skips them).
        planned: batch sizes of the windows planned but not committed when the checkpoint was written, within
            this fit's bounds; they are planned again, in order, before the controller's current batch size is used.
    """

    epoch: int
    samples_done: int
    planned: tuple[int, ...] = ()


@dataclass
class WindowSchedule:
    """State shared by the sampler (which plans windows) and the callback (which sets the batch size).

    Args:
        batch_size: the global batch size for the next window the sampler starts.
        max_micro_batch_size: per-rank cap of a micro-batch.
        world_size: number of ranks.
        min_micro_batches: 2 on one process (its halves are two halves of the window), else 1.
        seed: seed of the shuffling permutation; identical on all ranks.
        epoch: returns the epoch being iterated (read when an epoch's iterator starts).
        epoch_limit: most samples an epoch feeds (None: the whole dataset).
        samples_left: returns how many samples the fit may still train (read when an epoch's iterator
            starts, when every window planned before has been trained); ``math.inf`` when unbounded.
            The window that reaches it is cut to exactly what is left.
    """

    batch_size: int
    max_micro_batch_size: int
    world_size: int = 1
    min_micro_batches: int = 1
    seed: int = 0
    epoch: Callable[[], int] = lambda: 0
    epoch_limit: int | None = None
    samples_left: Callable[[], float] = lambda: math.inf
    current: EpochPlan = field(default_factory=EpochPlan)
    # where a run resumed in the middle of an epoch picks it up
    resume_from: ResumePoint | None = None

    def plan(self, available: int, take_small_remainder: bool = True, batch_size: int | None = None) -> Window:
        return plan_window(
            self.batch_size if batch_size is None else batch_size,
            available,
            self.world_size,
            self.max_micro_batch_size,
            self.min_micro_batches,
            even_micro_batches=self.min_micro_batches >= 2,
            take_small_remainder=take_small_remainder,
        )


def shuffles(sampler: Any) -> bool | None:
    """Whether the sampler's order is a permutation SimiGrad regenerates (True), the sequence (False), or an order it
    can only take as it comes (None: a sampler with replacement, of its own length, weighted or of the user's own),
    which a resumed run cannot pick up in the middle of an epoch."""
    if isinstance(sampler, DistributedSampler):
        return sampler.shuffle
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler._num_samples is not None:
            return None  # a sampler with replacement or its own length has an order we can't regenerate
        return True
    if isinstance(sampler, SequentialSampler):
        return False
    return None


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
        if schedule.world_size > 1 and self._shuffles() is None:
            raise ValueError(
                f"SimiGrad shards samples across ranks itself, walking one order that every rank can regenerate: a"
                f" RandomSampler without replacement or a SequentialSampler, not this `{type(sampler).__name__}`."
                f" Use `shuffle=True` or `shuffle=False` in the DataLoader."
            )

    def _num_samples(self) -> int:
        """Dataset size behind one of the samplers whose order we generate ourselves."""
        sampler = self.sampler
        if isinstance(sampler, DistributedSampler):
            return len(sampler.dataset)  # type: ignore[arg-type]
        assert isinstance(sampler, (RandomSampler, SequentialSampler))
        return len(sampler.data_source)  # type: ignore[arg-type]

    def _shuffles(self) -> bool | None:
        """True/False for orders we generate ourselves, None for a foreign sampler's own order."""
        return shuffles(self.sampler)

    def epoch_order(self, epoch: int) -> list[int]:
        """The global index order of an epoch: identical on every rank, and again after a resume."""
        shuffle = self._shuffles()
        if shuffle is None:
            return list(iter(self.sampler))
        n = self._num_samples()
        if not shuffle:
            return list(range(n))
        generator = torch.Generator()
        generator.manual_seed(self.schedule.seed + epoch)
        return torch.randperm(n, generator=generator).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        schedule = self.schedule
        epoch = schedule.epoch()
        order = self.epoch_order(epoch)
        data_end = len(order) if schedule.epoch_limit is None else min(len(order), schedule.epoch_limit)
        position = 0
        replay: deque[int] = deque()
        resume = schedule.resume_from
        if resume is not None and resume.epoch == epoch:
            position = resume.samples_done
            replay = deque(resume.planned)
        # the fit's sample budget cuts the window that reaches it to exactly what is left; windows after it
        # are planned as usual but never trained (the callback stops the fit), so the epoch does not
        # look finished to Lightning, as with any stop in the middle of an epoch
        budget = schedule.samples_left()
        plan = EpochPlan(epoch, end=int(min(data_end, position + max(budget, 0))), planned=position)
        schedule.current = plan
        while position < data_end:
            requested = replay.popleft() if replay else schedule.batch_size
            if self.drop_last and data_end - position < requested:
                break  # the data's own tail, smaller than a window
            end = data_end if budget <= 0 else int(min(data_end, position + budget))
            # a remainder drop_last would drop is not folded into the window before it
            take_rest = not (self.drop_last and end == data_end)
            window = schedule.plan(end - position, take_small_remainder=take_rest, batch_size=requested)
            budget -= window.total
            plan.append(window, requested)
            plan.planned = position + window.total
            if plan.last_window is None and plan.planned >= plan.end:
                plan.last_window, plan.ends_epoch = plan.planned_windows - 1, plan.end == data_end
            for j in range(window.num_micro_batches):
                start = position + window.offset(j, self.rank)
                size = window.sizes[j][self.rank]
                # a rank left without samples in a tiny epoch still steps: it feeds one sample that
                # the callback weighs by zero
                yield order[start : start + size] if size else [order[position]]
            position += window.total
        if plan.last_window is None:  # drop_last dropped the tail: the epoch ends with the last window
            plan.last_window, plan.ends_epoch, plan.end = plan.planned_windows - 1, True, position

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
