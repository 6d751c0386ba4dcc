"""An epoch's windows over the positions of its samples, known ahead (map-style data), whatever hands them out.

:func:`walk_epoch` is the feeder of data whose positions are known ahead (the map-style
:class:`~lightning_simigrad.data.sampler.AdaptiveBatchSampler` hands its windows to the ranks; a stream's windows
are sized from what arrives, in :mod:`~lightning_simigrad.data.stream`). What every feeder shares -- where a resumed
epoch starts, what each window asks for, the fit's budget, the record in the schedule's
:class:`~lightning_simigrad.data.schedule.EpochPlan` -- is :class:`~lightning_simigrad.data.planner.EpochPlanner`'s;
what is positional is here: each window takes the positions the batch asked for, the one that reaches the fit's
budget ends exactly there, the epoch's last two windows share what is left
(:func:`~lightning_simigrad.core.plan.tail_window`), and ``drop_last`` drops a tail smaller than its window. It
knows positions only, not samples.

Where samples weigh unalike (tokens), the walk is handed the weight of every position: a window then takes the
consecutive positions whose weight comes nearest the batch asked for (never fewer than a measurement needs:
:meth:`~lightning_simigrad.data.schedule.WindowSchedule.measurable`), the fit's budget cuts the window that reaches
it just past it (within one sample), and the unit cuts the window's samples into slots by their weights
(:meth:`~lightning_simigrad.core.units.Unit.cut`). Everything else -- the tail, ``drop_last``, a resume -- still
counts positions.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lightning_simigrad.core.plan import Window, tail_window
from lightning_simigrad.data.planner import EpochPlanner, Positions
from lightning_simigrad.data.schedule import WindowSchedule

__all__ = ["walk_epoch"]


@dataclass
class _Walk:
    """Where the walk over the epoch's positions stands, beside the planner's: its data's end, what the last window
    planned held, and the share of the epoch's tail still owed to its last window."""

    planner: EpochPlanner
    data_end: int
    length: int
    drop_last: bool
    previous: int = 0  # the window planned before (0: none in this walk)
    share: int | None = None  # the epoch's last window: what the window before it left


def walk_epoch(
    schedule: WindowSchedule, epoch: int, length: int, drop_last: bool, weights: torch.Tensor | None = None
) -> Iterator[tuple[Window, int]]:
    """Plan ``epoch``'s windows over its first ``length`` positions (``schedule.epoch_limit`` may cut it shorter);
    yields each window with the position of its first sample, after recording it in ``schedule.current``.
    ``weights``: the weight of every position, where samples weigh unalike.

    >>> schedule = WindowSchedule(batch_size=4, max_micro_batch_size=2, min_micro_batches=2)
    >>> [(window.sizes, start) for window, start in walk_epoch(schedule, 0, 10, drop_last=False)]
    [(((2,), (2,)), 0), (((2,), (2,), (2,)), 4)]

    (The 2 samples a second window of 4 would leave are too few for a window of their own: the last takes them.)
    """
    data_end = length if schedule.epoch_limit is None else min(length, schedule.epoch_limit)
    walk = _Walk(EpochPlanner(schedule, epoch, Positions(weights), end=data_end), data_end, length, drop_last)
    while walk.planner.position < data_end:
        planned = _next_window(walk)
        if planned is None:
            break  # the data's own tail, smaller than a window, under drop_last
        window, recorded, tail = planned
        yield window, walk.planner.record(window, recorded, tail)
    walk.planner.finish()


def _next_window(walk: _Walk) -> tuple[Window, int, bool] | None:
    """The next window from the walk's position, what a resumed run asks for to plan it again and whether that is a
    share of the epoch's tail; None where ``drop_last`` drops the rest."""
    planner, schedule = walk.planner, walk.planner.schedule
    position, positions = planner.position, planner.positions
    asked = planner.asked()
    requested, tail = _requested(walk, asked)
    if walk.drop_last and walk.data_end - position < requested:
        return None
    end = walk.data_end if planner.budget <= 0 else int(min(walk.data_end, planner.reach_budget()))
    take_rest = not (walk.drop_last and end == walk.data_end)  # a remainder drop_last drops is not folded in
    if take_rest and end == walk.data_end:
        # the epoch's last two windows share what is left rather than leave the last a sliver; the request recorded
        # for the last is its share, so that a resumed run plans the same windows
        shared = tail_window(requested, end - position, walk.previous)
        if shared != requested:
            requested, tail = shared, True
            walk.share = end - position - shared if shared < end - position else None
    window = schedule.plan(end - position, take_small_remainder=take_rest, batch_size=requested)
    window = schedule.cut(window, positions.of(position, window.total))  # the unit cuts its samples into slots
    walk.previous = window.total
    # what a resumed run asks for to plan this window again: the batch asked for, or the tail's share in the unit
    # (its positions' weight), which leads back to the same positions
    recorded = positions.weight_before(position + requested) - positions.weight_before(position) if tail else asked
    return window, recorded, tail


def _requested(walk: _Walk, asked: int) -> tuple[int, bool]:
    """The positions the next window asks for (never fewer than a measurement needs, whatever their weight: a window
    of one sequence has no halves), and whether that is a share of the epoch's tail rather than the batch asked for."""
    position, positions = walk.planner.position, walk.planner.positions
    if walk.share is not None:
        share, walk.share = walk.share, None
        return share, True
    reach = positions.reach(position, asked)  # past the data's end: more than is left
    requested = int(reach) - position if math.isfinite(reach) else walk.length + 1 - position
    return max(requested, walk.planner.schedule.measurable()), False
