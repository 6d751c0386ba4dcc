r"""Fixed batch-size schedules: the global batch size as a function of what a fit has trained.

What large-scale training picks instead of an adaptive batch is a schedule known ahead: GPT-3's linear ramp,
OLMo's doublings at fixed token counts, Megatron's step schedule. A :class:`BatchSchedule` is one, in the unit
batch sizes count (samples, or tokens with ``lengths``): ``schedule(trained)`` is the global batch size of the step
that starts after ``trained`` samples (tokens). :class:`~lightning_simigrad.BatchSizeSchedule` trains with it;
because it is known ahead, the windows a DataLoader plans ahead of training follow it exactly.

>>> ramp = linear_ramp(start=32, end=256, over=10_000)
>>> ramp(0), ramp(5_000), ramp(10_000), ramp(99_999)
(32, 144, 256, 256)
>>> steps = BatchSchedule.of({0: 64, 1_000: 128, 5_000: 256})
>>> steps(999), steps(1_000), steps(7_000)
(64, 128, 256)
>>> doubling(64, at=[1_000, 3_000])(2_000)
128
>>> BatchSchedule.of({100: 64})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: `schedule` = {100: 64} gives no batch size for the first step: add the key 0 ...
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["BatchSchedule", "doubling", "linear_ramp"]


class BatchSchedule:
    """A global batch size for every point of training, checked when it is made.

    Args:
        size_at: ``size_at(trained)``: the global batch size of the step after ``trained`` samples.
        describe: how the schedule reads in messages.
        steps: the dict ``{samples trained: batch size}`` it was made of, if any.

    Attributes:
        recorded: its sizes are the windows a finished run trained
            (:func:`~lightning_simigrad.core.replay.recorded_schedule`), asked for as they are, never brought within
            the fit's bounds: an epoch's last two windows share what the epoch has left, and a share below the
            smallest batch (``min_batch_size``; in tokens, the two sequences at the mean length a measurement needs)
            raised to it would plan other windows than the run planned.
    """

    def __init__(self, size_at: Callable[[int], Any], describe: str, steps: dict[int, int] | None = None) -> None:
        self._size_at, self.describe, self.steps = size_at, describe, steps
        self.recorded = False

    @classmethod
    def of(cls, schedule: Any) -> BatchSchedule:
        """A schedule from a function of the samples trained, or a dict ``{samples trained: batch size}`` of steps."""
        if isinstance(schedule, BatchSchedule):
            return schedule
        if isinstance(schedule, Mapping):
            return cls._of_steps(schedule)
        if callable(schedule):
            made = cls(schedule, getattr(schedule, "__name__", repr(schedule)))
            made(0)  # a function that cannot give the first step's size is refused now, not at the first step
            return made
        raise ValueError(
            f"`schedule` = {schedule!r} is a `{type(schedule).__name__}`; pass a function of the samples trained that"
            " returns the global batch size, or a dict {samples trained: batch size} (e.g. {0: 64, 100_000: 128}),"
            " or `linear_ramp(...)` / `doubling(...)`."
        )

    @classmethod
    def _of_steps(cls, steps: Mapping[Any, Any]) -> BatchSchedule:
        shown = dict(steps)
        for point, size in shown.items():
            if isinstance(point, bool) or not isinstance(point, int) or point < 0:
                raise ValueError(
                    f"`schedule` = {shown!r} has the key {point!r}: keys are the samples trained, non-negative ints."
                )
            _check_size(size, f"`schedule` = {shown!r} gives {size!r} at {point}")
        if 0 not in shown:
            raise ValueError(
                f"`schedule` = {shown!r} gives no batch size for the first step: add the key 0 (the batch size at 0"
                " samples trained)."
            )
        points = sorted(shown)
        sizes = [shown[p] for p in points]

        def size_at(trained: int) -> int:
            return sizes[bisect.bisect_right(points, trained) - 1]

        return cls(size_at, repr(shown), dict(zip(points, sizes)))

    def __call__(self, trained: int) -> int:
        """The global batch size of the step after ``trained`` samples; a size that is not a positive int is refused,
        naming where the schedule gave it."""
        size = self._size_at(trained)
        return _check_size(size, f"`schedule` ({self.describe}) gave {size!r} for {trained} samples trained")

    def check_bounds(self, low: int | None, high: int | None, points: Sequence[int] = ()) -> None:
        """Refuse a schedule that leaves ``[low, high]`` at 0 or at any of ``points``."""
        for trained in (0, *points):
            size = self(trained)
            if (low is not None and size < low) or (high is not None and size > high):
                raise ValueError(
                    f"`schedule` ({self.describe}) gives {size} at {trained} samples trained, outside"
                    f" [min_batch_size, max_batch_size] = [{low}, {high}]: change the schedule or the bounds."
                )


def linear_ramp(start: int, end: int, over: int) -> BatchSchedule:
    """GPT-3's ramp: from ``start`` at 0 samples linearly to ``end`` at ``over`` samples, then ``end``."""
    _check_size(start, f"`start` = {start!r}")
    _check_size(end, f"`end` = {end!r}")
    if isinstance(over, bool) or not isinstance(over, int) or over <= 0:
        raise ValueError(f"`over` = {over!r}: the samples the ramp takes, a positive int.")

    def size_at(trained: int) -> int:
        fraction = min(trained, over) / over
        return round(start + (end - start) * fraction)

    return BatchSchedule(size_at, f"linear_ramp({start}, {end}, over={over})")


def doubling(start: int, at: Sequence[int]) -> BatchSchedule:
    """OLMo's warm-up: ``start``, doubled at each point of ``at`` (samples trained)."""
    _check_size(start, f"`start` = {start!r}")
    points = list(at)
    if any(isinstance(p, bool) or not isinstance(p, int) or p <= 0 for p in points) or points != sorted(set(points)):
        raise ValueError(f"`at` = {points!r}: increasing positive ints, the samples trained where the batch doubles.")
    return BatchSchedule.of({0: start, **{p: start * 2 ** (i + 1) for i, p in enumerate(points)}})


def _check_size(size: Any, where: str) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"{where}: a batch size must be a positive int.")
    return size
