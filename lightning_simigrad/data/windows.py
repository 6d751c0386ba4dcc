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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from lightning_simigrad.core.plan import Window, tail_window
from lightning_simigrad.data.schedule import EpochPlan, WindowSchedule

__all__ = ["walk_epoch"]


def walk_epoch(schedule: WindowSchedule, epoch: int, length: int, drop_last: bool) -> Iterator[tuple[Window, int]]:
    """Plan ``epoch``'s windows over its first ``length`` positions (``schedule.epoch_limit`` may cut it shorter);
    yields each window with the position of its first sample, after recording it in ``schedule.current``.

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
    before_epoch = schedule.trained() - position
    # the fit's budget cuts the window that reaches it to exactly what is left; windows after it are planned as usual
    # but never trained (the run stops the fit), so the epoch does not look finished to Lightning, as with any stop
    # in the middle of an epoch
    budget = schedule.samples_left()
    plan = EpochPlan(epoch, end=int(min(data_end, position + max(budget, 0))), planned=position)
    schedule.current = plan
    share: int | None = None  # the epoch's last window: what the window before it left
    previous = 0  # the window planned before (0: none in this walk)
    while position < data_end:
        requested = replay.popleft() if replay else schedule.requested(before_epoch + position)
        if share is not None:
            requested, share = share, None
        if drop_last and data_end - position < requested:
            break  # the data's own tail, smaller than a window
        end = data_end if budget <= 0 else int(min(data_end, position + budget))
        # a remainder drop_last would drop is not folded into the window before it
        take_rest = not (drop_last and end == data_end)
        if take_rest and end == data_end:
            # the epoch's last two windows share what is left rather than leave the last a sliver; the request recorded
            # for the last is its share, so that a resumed run plans the same windows
            shared = tail_window(requested, end - position, previous)
            if shared != requested:
                requested = shared
                share = end - position - shared if shared < end - position else None
        window = schedule.plan(end - position, take_small_remainder=take_rest, batch_size=requested)
        budget -= window.weight
        previous = window.total
        plan.append(window, requested)
        plan.planned = position + window.total
        if plan.last_window is None and plan.planned >= plan.end:
            plan.last_window, plan.ends_epoch = plan.planned_windows - 1, plan.end == data_end
        yield window, position
        position += window.total
    if plan.last_window is None:  # drop_last dropped the tail: the epoch ends with the last window
        plan.last_window, plan.ends_epoch, plan.end = plan.planned_windows - 1, True, position
