"""An epoch's windows, planned in order over the positions of its samples, whatever hands them to the ranks.

:func:`walk_epoch` is the loop of data whose positions are known ahead (the map-style
:class:`~lightning_simigrad.data.sampler.AdaptiveBatchSampler`; a stream's windows are sized from what arrives, in
:mod:`~lightning_simigrad.data.stream`): from where the epoch starts (a resumed epoch at
the samples it had committed, replaying the windows it had planned) it plans each window at the batch size the
controller asks for when the window starts (:meth:`~lightning_simigrad.data.schedule.WindowSchedule.plan`), cuts
the one that reaches the fit's budget to exactly what is left, lets the epoch's last two windows share what is left
(:func:`~lightning_simigrad.core.plan.tail_window`), drops a tail smaller than its window under ``drop_last``, and
records every window in the schedule's :class:`~lightning_simigrad.data.schedule.EpochPlan`, where the run reads
back which window and slot each micro-batch belongs to. It knows positions only, not samples.

Where batches are counted in tokens, the walk is handed the tokens of every position: a window then takes the
consecutive positions whose tokens come nearest the batch asked for (never fewer than a measurement needs:
:meth:`~lightning_simigrad.data.schedule.WindowSchedule.measurable`), the fit's budget cuts the
window that reaches it just past it (within one sequence), and the window's samples are cut into micro-batches by
:func:`~lightning_simigrad.core.token_plan.plan_token_window`. Everything else -- the tail, ``drop_last``, a resume
-- still counts positions.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator

import torch

from lightning_simigrad.core.plan import Window, tail_window
from lightning_simigrad.data.schedule import EpochPlan, WindowSchedule

__all__ = ["Positions", "walk_epoch"]


class Positions:
    """The weight before each position of an epoch's order: the position itself (samples), or, given the tokens of
    every position, their running sum.

    >>> tokens = Positions(torch.tensor([5, 1, 4, 4]))
    >>> tokens.weight_before(3), tokens.reach(0, 6), tokens.reach(0, 7), tokens.reach(0, 7, nearest=False)
    (10, 2, 2, 3)
    """

    def __init__(self, lengths: torch.Tensor | None = None) -> None:
        self.before = None if lengths is None else torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])

    def weight_before(self, position: int) -> int:
        return position if self.before is None else int(self.before[position])

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


def walk_epoch(
    schedule: WindowSchedule, epoch: int, length: int, drop_last: bool, lengths: torch.Tensor | None = None
) -> Iterator[tuple[Window, int]]:
    """Plan ``epoch``'s windows over its first ``length`` positions (``schedule.epoch_limit`` may cut it shorter);
    yields each window with the position of its first sample, after recording it in ``schedule.current``.
    ``lengths``: the tokens of every position, where batches count tokens.

    >>> schedule = WindowSchedule(batch_size=4, max_micro_batch_size=2, min_micro_batches=2)
    >>> [(window.sizes, start) for window, start in walk_epoch(schedule, 0, 10, drop_last=False)]
    [(((2,), (2,)), 0), (((2,), (2,), (2,)), 4)]

    (The 2 samples a second window of 4 would leave are too few for a window of their own: the last takes them.)
    """
    data_end = length if schedule.epoch_limit is None else min(length, schedule.epoch_limit)
    position = 0
    replay: deque[int] = deque()
    resume = schedule.resume_from
    if resume is not None and resume.epoch == epoch:
        position = resume.samples_done
        replay = deque(resume.planned)
    # what the fit trained before this epoch's first window: a fixed schedule sizes each window by what was trained
    # before it (planned windows train in order, so that is this plus the epoch's positions before the window)
    positions = Positions(lengths)
    before_epoch = schedule.trained() - positions.weight_before(position)
    # the fit's budget cuts the window that reaches it to exactly what is left; windows after it are planned as usual
    # but never trained (the run stops the fit), so the epoch does not look finished to Lightning, as with any stop
    # in the middle of an epoch
    budget = schedule.samples_left()
    first_end = positions.reach(position, max(budget, 0), nearest=False)
    plan = EpochPlan(epoch, end=int(min(data_end, first_end)), planned=position)
    schedule.current = plan
    share: int | None = None  # the epoch's last window: what the window before it left
    previous = 0  # the window planned before (0: none in this walk)
    while position < data_end:
        asked = replay.popleft() if replay else schedule.requested(before_epoch + positions.weight_before(position))
        reach = positions.reach(position, asked)  # in samples; past the data's end: more than is left
        requested = int(reach) - position if math.isfinite(reach) else length + 1 - position
        # never fewer samples than a measurement needs, whatever their tokens (a window of one sequence has no halves)
        requested = max(requested, schedule.measurable())
        tail = share is not None  # a share of the epoch's tail, not the batch asked for
        if share is not None:
            requested, share = share, None
        if drop_last and data_end - position < requested:
            break  # the data's own tail, smaller than a window
        end = data_end if budget <= 0 else int(min(data_end, positions.reach(position, budget, nearest=False)))
        # a remainder drop_last would drop is not folded into the window before it
        take_rest = not (drop_last and end == data_end)
        if take_rest and end == data_end:
            # the epoch's last two windows share what is left rather than leave the last a sliver; the request recorded
            # for the last is its share, so that a resumed run plans the same windows
            shared = tail_window(requested, end - position, previous)
            if shared != requested:
                requested, tail = shared, True
                share = end - position - shared if shared < end - position else None
        window = schedule.plan(end - position, take_small_remainder=take_rest, batch_size=requested)
        if lengths is not None:  # the same samples, cut into micro-batches by their tokens
            window = schedule.plan_tokens(lengths[position : position + window.total].tolist())
        budget -= window.weight
        previous = window.total
        # what a resumed run asks for to plan this window again: the batch asked for, or the tail's share, in samples
        # or (counted in tokens) the share's tokens, which lead back to the same positions
        recorded = requested if lengths is None else asked
        if lengths is not None and tail:
            recorded = positions.weight_before(position + requested) - positions.weight_before(position)
        plan.append(window, recorded)
        plan.planned = position + window.total
        if plan.last_window is None and plan.planned >= plan.end:
            plan.last_window, plan.ends_epoch = plan.planned_windows - 1, plan.end == data_end
        yield window, position
        position += window.total
    if plan.last_window is None:  # drop_last dropped the tail: the epoch ends with the last window
        plan.last_window, plan.ends_epoch, plan.end = plan.planned_windows - 1, True, position
