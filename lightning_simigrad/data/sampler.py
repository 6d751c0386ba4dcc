"""The batch sampler that feeds adaptive windows.

:class:`AdaptiveBatchSampler` replaces the training DataLoader's batch sampler. Each time it starts a
window it reads the batch size the controller currently asks for, plans the window
(:func:`~lightning_simigrad.core.plan.plan_window`) and yields this rank's micro-batches of it, recording the
window in the :class:`~lightning_simigrad.data.schedule.WindowSchedule` it shares with the run.

On several ranks all of them walk the same global order (a permutation seeded identically on every
rank) and each takes its slots of each window, so every sample is fed exactly once per epoch with no
padding, unlike ``DistributedSampler``.

Two bounds cut windows, both counted in samples: ``epoch_limit`` (Lightning's ``limit_train_batches``,
converted by the run) ends the epoch, and the fit's remaining sample budget (``max_steps`` in steps
of B0, or ``max_samples``) ends the window that reaches it. Either way the window is planned to exactly
what is left, as an epoch tail is, so no window is ever cut short by the training loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from lightning_simigrad import _compat
from lightning_simigrad.core.plan import tail_window
from lightning_simigrad.data.schedule import EpochPlan, WindowSchedule

__all__ = ["AdaptiveBatchSampler", "shuffles", "with_batch_sampler"]


def shuffles(sampler: Any) -> bool | None:
    """Whether the sampler's order is a permutation SimiGrad regenerates (True), the sequence (False), or an order it
    can only take as it comes (None: a sampler with replacement, of its own length, weighted or of the user's own),
    which a resumed run cannot pick up in the middle of an epoch."""
    if isinstance(sampler, DistributedSampler):
        return sampler.shuffle
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or _compat.random_sampler_length(sampler) is not None:
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
        # are planned as usual but never trained (the run stops the fit), so the epoch does not
        # look finished to Lightning, as with any stop in the middle of an epoch
        budget = schedule.samples_left()
        plan = EpochPlan(epoch, end=int(min(data_end, position + max(budget, 0))), planned=position)
        schedule.current = plan
        share: int | None = None  # the epoch's last window: what the window before it left
        previous = 0  # the window planned before (0: none in this iterator)
        while position < data_end:
            requested = replay.popleft() if replay else schedule.batch_size
            if share is not None:
                requested, share = share, None
            if self.drop_last and data_end - position < requested:
                break  # the data's own tail, smaller than a window
            end = data_end if budget <= 0 else int(min(data_end, position + budget))
            # a remainder drop_last would drop is not folded into the window before it
            take_rest = not (self.drop_last and end == data_end)
            if take_rest and end == data_end:
                # the epoch's last two windows share what is left rather than leave the last a sliver; the
                # request recorded for the last is its share, so that a resumed run plans the same windows
                shared = tail_window(requested, end - position, previous)
                if shared != requested:
                    requested = shared
                    share = end - position - shared if shared < end - position else None
            window = schedule.plan(end - position, take_small_remainder=take_rest, batch_size=requested)
            budget -= window.total
            previous = window.total
            plan.append(window, requested)
            plan.planned = position + window.total
            if plan.last_window is None and plan.planned >= plan.end:
                plan.last_window, plan.ends_epoch = plan.planned_windows - 1, plan.end == data_end
            for j in range(window.num_micro_batches):
                start = position + window.offset(j, self.rank)
                size = window.sizes[j][self.rank]
                # a rank left without samples in a tiny epoch still steps: it feeds one sample that
                # the run weighs by zero
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
