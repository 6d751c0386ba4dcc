"""The window schedule the sampler and the run share: the batch size asked for, and the windows planned ahead.

Because a DataLoader with workers draws index batches several micro-batches ahead of training, the sampler --
not the training loop -- is the authority on window boundaries: it records every window it plans in the
:class:`WindowSchedule`'s :class:`EpochPlan`, and the run reads back, micro-batch by micro-batch, which window
and slot the batch being trained belongs to. A decision therefore takes effect at the next window the sampler
starts, and every step still knows exactly which samples it averages.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from lightning_simigrad.core.fields import BOOL, NON_NEGATIVE_INT, POSITIVE_INT, Field, added_later, list_of
from lightning_simigrad.core.plan import Window, plan_window
from lightning_simigrad.core.units import Unit

__all__ = ["EpochPlan", "ResumePoint", "SchedulePiece", "WindowSchedule"]


@dataclass
class EpochPlan:
    """The windows one epoch's iterator has planned and training has not finished, with the training cursor.

    ``windows[0]`` is the window being trained; windows are dropped once training moves past them, so the
    plan holds only the few windows the DataLoader has drawn ahead (its memory does not grow with the epoch).
    ``requests[i]`` is the batch size ``windows[i]`` was planned with, and ``tails[i]`` whether that was a share of
    the epoch's tail rather than a batch size asked for (a share may lie below the fit's ``min_batch_size``).

    ``end`` is the sample position where the epoch's training stops (the data's end, a limit, or the fit's
    budget) and ``planned`` how far windows are planned; once a window reaches ``end``, ``last_window``
    is its index among all the epoch's windows and ``ends_epoch`` tells whether that is the data's end
    rather than a stop.
    """

    epoch: int = 0
    windows: deque[Window] = field(default_factory=deque)
    requests: deque[int] = field(default_factory=deque)
    tails: deque[bool] = field(default_factory=deque)
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

    def append(self, window: Window, requested: int, tail: bool = False) -> None:
        self.windows.append(window)
        self.requests.append(requested)
        self.tails.append(tail)

    def next_micro_batch(self) -> tuple[Window, int]:
        """Advance to the next micro-batch the trainer receives; returns its window and index in it."""
        self._micro += 1
        if self._micro >= self.windows[0].num_micro_batches:
            self.windows.popleft()
            self.requests.popleft()
            self.tails.popleft()
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
    def first_pending(self) -> int:
        """The index among the epoch's windows of the first one no optimizer step has averaged."""
        return self._dropped + (1 if self._micro >= 0 and self._committed else 0)

    @property
    def pending(self) -> list[int]:
        """Batch sizes of the planned windows no optimizer step has averaged yet, in order."""
        return self._unaveraged(self.requests)

    @property
    def pending_tails(self) -> list[bool]:
        """Which of :attr:`pending` are shares of the epoch's tail."""
        return self._unaveraged(self.tails)

    def _unaveraged(self, per_window: deque[Any]) -> list[Any]:
        started = self._micro >= 0
        return list(per_window)[1:] if started and self._committed else list(per_window)

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
class SchedulePiece:
    """The schedule's piece of a checkpoint (:meth:`WindowSchedule.state_dict`), read.

    Args:
        batch_size: the batch size asked for.
        seed: the shuffling seed every rank agreed on.
        epoch: the data's epoch being trained.
        planned: the batch sizes of the windows planned that no optimizer step had averaged, in order.
        epoch_offset: how far the training loop's epoch count ran ahead of the data's.
        planned_tails: which of ``planned`` are shares of the epoch's tail (a resume keeps them as they are: bounds
            hold for the batch sizes asked for, not for the tail's shares).
    """

    batch_size: int
    seed: int
    epoch: int
    planned: tuple[int, ...] = ()
    epoch_offset: int = 0
    planned_tails: tuple[bool, ...] = ()

    @classmethod
    def of(cls, piece: dict[str, Any]) -> SchedulePiece:
        """The piece as :meth:`WindowSchedule.state_dict` wrote it (checked against ``STATE_FIELDS``)."""
        return cls(
            int(piece["batch_size"]),
            int(piece["seed"]),
            int(piece["epoch"]),
            tuple(int(size) for size in piece["planned"]),
            int(piece.get("epoch_offset", 0)),  # (added after checkpoints were written without it)
            tuple(bool(tail) for tail in piece.get("planned_tails", ())),  # (likewise; no tail then)
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "seed": self.seed,
            "epoch": self.epoch,
            "planned": list(self.planned),
            "epoch_offset": self.epoch_offset,
            "planned_tails": list(self.planned_tails),
        }


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
    """State shared by the sampler (which plans windows) and the run (which sets the batch size).

    Args:
        batch_size: the global batch size for the next window the sampler starts.
        max_micro_batch_size: per-rank cap of a micro-batch.
        world_size: number of ranks.
        min_micro_batches: 2 on one process (its halves are two halves of the window), else 1.
        seed: seed of the shuffling permutation; identical on all ranks.
        epoch: returns the epoch of the data being iterated (read when an epoch's iterator starts).
        epoch_limit: most samples an epoch feeds (None: the whole dataset).
        weight_left: returns the weight the fit may still train, in the unit (read when an epoch's iterator
            starts, when every window planned before has been trained); ``math.inf`` when unbounded.
            The window that reaches it is cut to exactly what is left.
        trained: returns the weight the fit has trained (read when an epoch's iterator starts, as ``weight_left``).
        planner: a fixed schedule: the batch size of the window that starts after a given weight trained (None: the
            controller's ``batch_size``, which a decision changes).
        unit: what batch sizes count; it cuts a window's samples into slots (:meth:`cut`).
        weights: every sample's weight in the unit, by dataset index (an int64 tensor; None: every sample weighs 1).
    """

    batch_size: int
    max_micro_batch_size: int
    world_size: int = 1
    min_micro_batches: int = 1
    seed: int = 0
    epoch: Callable[[], int] = lambda: 0
    epoch_limit: int | None = None
    weight_left: Callable[[], float] = lambda: math.inf
    trained: Callable[[], int] = lambda: 0
    planner: Callable[[int], int] | None = None
    unit: Unit = field(default_factory=Unit)
    weights: Any = None
    current: EpochPlan = field(default_factory=EpochPlan)
    # where a run resumed in the middle of an epoch picks it up
    resume_from: ResumePoint | None = None
    # the training loop's epoch count less the data's epoch (``epoch``): 1 once a fit resumed from a checkpoint written
    # where `max_steps` stopped an epoch, which Lightning counts as done and then finishes as its next epoch
    epoch_offset: int = 0

    STATE_FIELDS: ClassVar[dict[str, Field]] = {
        "batch_size": POSITIVE_INT,
        "seed": NON_NEGATIVE_INT,
        "epoch": NON_NEGATIVE_INT,
        "planned": list_of(POSITIVE_INT, "a list of positive ints"),
        "epoch_offset": added_later(NON_NEGATIVE_INT, 0),
        "planned_tails": added_later(list_of(BOOL, "a list of bools"), []),
    }

    def state_dict(self) -> dict[str, Any]:
        """The schedule's piece of the checkpoint: the batch size asked for, the shuffling seed, the data's epoch being
        trained, the batch sizes of the windows planned that no optimizer step has averaged yet, and how far the
        training loop's epoch count runs ahead of the data's."""
        piece = SchedulePiece(
            self.batch_size,
            self.seed,
            self.current.epoch,
            tuple(self.current.pending),
            self.epoch_offset,
            tuple(self.current.pending_tails),
        )
        return piece.state_dict()

    def load_state_dict(self, piece: SchedulePiece, resume_from: ResumePoint | None = None) -> None:
        """Take a checkpoint's piece back (its batch size already brought within this fit's bounds, its epoch offset
        the resumed fit's); a resumed epoch starts at ``resume_from``."""
        self.batch_size, self.seed, self.epoch_offset = piece.batch_size, piece.seed, piece.epoch_offset
        self.resume_from = resume_from

    def measurable(self) -> int:
        """The fewest samples a measured window holds: one in each of the halves' slots on every rank (sequences,
        where batches count tokens)."""
        return self.world_size * self.min_micro_batches

    def requested(self, trained: int) -> int:
        """The batch size a window asks for when it starts after ``trained`` weight: the schedule's, or the
        controller's latest decision."""
        return self.batch_size if self.planner is None else self.planner(trained)

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

    def typical_window(self, asked: float) -> Window:
        """A window of the batch ``asked`` for as the schedule would plan it, before the epoch's samples are known (for
        estimates): of ``asked`` samples; where samples weigh unalike, of as many as the data's mean weight gives,
        their weights spread as the data's are (evenly spaced quantiles: padding depends on the spread)."""
        if self.weights is None:
            return self.plan(max(1, int(asked)))
        ordered = self.weights.sort().values
        samples = max(self.measurable(), round(asked / float(ordered.double().mean())))
        picks = torch.linspace(0, len(ordered) - 1, samples).round().long()
        return self.cut(self.plan(samples), ordered[picks].tolist())

    def cut(self, window: Window, weights: list[int] | None) -> Window:
        """The slots of ``window``'s samples (of these ``weights``, where samples weigh unalike), as the unit cuts
        them."""
        return self.unit.cut(
            window,
            weights,
            self.world_size,
            self.max_micro_batch_size,
            self.min_micro_batches,
            even=self.min_micro_batches >= 2,
        )

    def weights_in(self, order: Any) -> Any:
        """The weights of the samples of an epoch's ``order`` (a tensor of dataset indices), in that order; None where
        every sample weighs 1."""
        return None if self.weights is None else self.weights[order]
