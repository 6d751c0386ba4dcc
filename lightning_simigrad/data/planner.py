"""One epoch's windows, planned in order: the part every source shares.

An epoch's windows come from one of two feeders: positions known ahead (map-style data,
:func:`~lightning_simigrad.data.windows.walk_epoch`, which the batch sampler hands out) or loader batches as they
arrive (a stream, :class:`~lightning_simigrad.data.stream.StreamWindows`). What a window *is* differs between them;
everything else is this module's, once:

- where the epoch starts: at the samples a resumed epoch had committed, its planned windows asked for again first,
  in order, so that the resumed run plans the windows the uninterrupted run planned;
- what each window asks for: the replayed size, else the schedule's batch size for the weight trained before it (a
  fixed schedule's, or the controller's latest decision);
- the fit's budget, the weight it may still train: the window that reaches it is cut to exactly what is left;
- the record every window leaves in the schedule's :class:`~lightning_simigrad.data.schedule.EpochPlan`, where the
  run reads back which window and slot each micro-batch belongs to, and where the epoch's training ends.

:class:`Positions` is the weight before each position of the epoch's order (the position itself where every sample
weighs 1, a running sum of the unit's weights where they differ).
"""

from __future__ import annotations

import math
from collections import deque

import torch

from lightning_simigrad.core.plan import Window
from lightning_simigrad.data.schedule import EpochPlan, WindowSchedule

__all__ = ["EpochPlanner", "Positions"]


class Positions:
    """The weight before each position of an epoch's order: the position itself (samples), or, given the weight of
    every position, their running sum.

    >>> tokens = Positions(torch.tensor([5, 1, 4, 4]))
    >>> tokens.weight_before(3), tokens.reach(0, 6), tokens.reach(0, 7), tokens.reach(0, 7, nearest=False)
    (10, 2, 2, 3)
    >>> tokens.of(1, 2), Positions().of(1, 2)
    ([1, 4], None)
    """

    def __init__(self, weights: torch.Tensor | None = None) -> None:
        self.weights = weights
        self.before = None if weights is None else torch.cat([weights.new_zeros(1), weights.cumsum(0)])

    def weight_before(self, position: int) -> int:
        return position if self.before is None else int(self.before[position])

    def of(self, position: int, count: int) -> list[int] | None:
        """The weights of ``count`` positions from ``position`` (None where every sample weighs 1)."""
        return None if self.weights is None else self.weights[position : position + count].tolist()

    def reach(self, position: int, weight: float, nearest: bool = True) -> float:
        """The position where ``weight`` from ``position`` is reached: the nearest one (at least one sample on), or,
        with ``nearest=False``, the first at or past it; ``math.inf`` past the epoch's end."""
        if self.before is None or math.isinf(weight):
            return position + weight
        target = int(self.before[position]) + math.ceil(weight)
        past = int(torch.searchsorted(self.before, target, side="left"))
        if past >= len(self.before):
            return math.inf
        if nearest and past - 1 > position and target - self.before[past - 1] < self.before[past] - target:
            return past - 1
        return max(past, position + 1)


class EpochPlanner:
    """The planning of one epoch's windows that every feeder shares (see the module docstring).

    Args:
        schedule: the shared schedule: its resume point, batch size, budget, and the plan it records into.
        epoch: the data's epoch being planned.
        positions: the weight before each position (:class:`Positions`; a stream's samples weigh 1 each).
        end: where the epoch's data ends, in positions (None: unknown, a stream, whose plan ends where the windows
            that arrived end).

    >>> schedule = WindowSchedule(batch_size=4, max_micro_batch_size=2, weight_left=lambda: 6.0)
    >>> planner = EpochPlanner(schedule, epoch=0, end=10)
    >>> planner.asked(), planner.budget, schedule.current.end
    (4, 6.0, 6)
    """

    def __init__(
        self, schedule: WindowSchedule, epoch: int, positions: Positions | None = None, end: int | None = None
    ) -> None:
        self.schedule, self.positions = schedule, positions or Positions()
        resume = schedule.resume_from
        self.resumed = resume is not None and resume.epoch == epoch  # inside the epoch a checkpoint was written in
        self.position = resume.samples_done if resume is not None and self.resumed else 0
        self.replay: deque[int] = deque(resume.planned if resume is not None and self.resumed else ())
        # what the fit trained before this epoch's first window: a fixed schedule sizes each window by what was
        # trained before it (planned windows train in order, so that is this plus the epoch's weight before it)
        self.before_epoch = schedule.trained() - self.positions.weight_before(self.position)
        # windows after the one that reaches the budget are planned as usual but never trained (the run stops the
        # fit), so the epoch does not look finished to Lightning, as with any stop in the middle of an epoch
        self.budget = schedule.weight_left()
        self.end = end
        stop = self.position if end is None else int(min(end, self.reach_budget()))
        self.plan = schedule.current = EpochPlan(epoch, end=stop, planned=self.position)

    def asked(self) -> int:
        """The batch size the next window asks for: a replayed window's, else the schedule's."""
        if self.replay:
            return self.replay.popleft()
        return self.schedule.requested(self.before_epoch + self.positions.weight_before(self.position))

    def reach_budget(self) -> float:
        """The position where the fit's budget is spent, from the next window's first (``math.inf``: unbounded)."""
        return self.positions.reach(self.position, max(self.budget, 0), nearest=False)

    def record(self, window: Window, recorded: int, tail: bool = False) -> int:
        """The next window, planned from the position it returns, asked for as ``recorded`` (what a resumed run asks
        for to plan it again; ``tail``: a share of the epoch's tail)."""
        start, plan = self.position, self.plan
        self.budget -= window.weight
        plan.append(window, recorded, tail)
        self.position = plan.planned = start + window.total
        if self.end is None:  # a stream's epoch ends where what arrived ends
            plan.end = self.position
        elif plan.last_window is None and plan.planned >= plan.end:
            plan.last_window, plan.ends_epoch = plan.planned_windows - 1, plan.end == self.end
        return start

    def finish(self) -> None:
        """No window follows (the data ran out, or ``drop_last`` dropped its tail): the last planned ends the epoch."""
        plan = self.plan
        if plan.last_window is None:
            plan.last_window, plan.ends_epoch, plan.end = plan.planned_windows - 1, True, self.position
