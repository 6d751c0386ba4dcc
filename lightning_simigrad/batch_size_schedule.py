"""BatchSizeSchedule: a fixed batch-size schedule (a ramp, doublings, steps), trained with SimiGrad's machinery.

The callback is :class:`~lightning_simigrad.SimiGrad` with the controller's decisions replaced by a schedule known
ahead (:mod:`lightning_simigrad.core.batch_schedules`): the same exact windows (every step the mean over exactly
its samples, each sample once per epoch, under DDP and FSDP), the same learning-rate coupling, step-based settings
counted in samples, checkpoints and logging. It still measures the two halves' similarity and the noise scale
every step and logs them, without acting on them. Because the schedule is known ahead, the windows a DataLoader
plans ahead of training follow it exactly: every step's size is what the schedule gives for the samples trained
before it (the epoch's last two windows share what is left, as with SimiGrad).
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning_simigrad.callback import SimiGrad
from lightning_simigrad.core.batch_schedules import BatchSchedule
from lightning_simigrad.core.settings import BatchSettings, Settings

__all__ = ["BatchSizeSchedule"]

# the similarity it logs is measured, never compared: any valid target serves
_UNUSED_TARGET = 0.5


class BatchSizeSchedule(SimiGrad):
    """Train with a fixed global batch-size schedule instead of an adaptive one.

    Args:
        schedule: ``schedule(trained)`` gives the global batch size of the step after ``trained`` samples; or a
            dict ``{samples trained: batch size}`` of steps (it must hold the key 0); or
            :func:`~lightning_simigrad.linear_ramp` / :func:`~lightning_simigrad.doubling`.
        initial_batch_size: B0, the batch the configured learning rate belongs to (default: the schedule's first
            size, ``schedule(0)``): with ``lr_scaling="sqrt"`` (the default) the learning rate follows
            ``sqrt(B / B0)`` along the ramp; ``lr_scaling="none"`` keeps it as your scheduler sets it.
        **arguments: :class:`~lightning_simigrad.SimiGrad`'s arguments that apply to any batch: ``min_batch_size``,
            ``max_batch_size`` (the schedule is refused if it leaves them at its first size or at a step of a dict),
            ``max_micro_batch_size``, ``lr_scaling``, ``lr_scaling_blend``, ``schedule_by_samples``,
            ``max_samples``, ``progress_bar``, ``history_size``, ``loss_items``.

    Raises:
        ValueError: at construction, for a schedule that is not a function or a dict, gives a size that is not a
            positive int, or leaves the bounds; during the fit, for a function that later gives such a size.

    Example::

        from lightning_simigrad import BatchSizeSchedule, linear_ramp

        ramp = BatchSizeSchedule(linear_ramp(start=256, end=4096, over=2_000_000), max_micro_batch_size=128)
        trainer = L.Trainer(callbacks=[ramp])
    """

    # read back as attributes (`callback.max_batch_size`); the schedule is `callback.settings.schedule` (the
    # `schedule` attribute is the windows planned, as on SimiGrad)
    ARGUMENTS = frozenset(BatchSettings.__dataclass_fields__)

    def __init__(self, schedule: Any, **arguments: Any) -> None:  # noqa: D107 (documented on the class)
        unknown = sorted(set(arguments) - set(BatchSettings.__dataclass_fields__))
        if unknown:
            raise TypeError(
                f"BatchSizeSchedule() got unexpected argument(s) {', '.join(unknown)}: a schedule decides the batch,"
                " so the controller's arguments do not apply (SimiGrad takes them)."
            )
        planned = BatchSchedule.of(schedule)
        points = list(schedule) if isinstance(schedule, dict) else []
        planned.check_bounds(arguments.get("min_batch_size"), arguments.get("max_batch_size"), points)
        if arguments.get("initial_batch_size") is None:
            arguments["initial_batch_size"] = planned(0)
        settings = Settings(_UNUSED_TARGET, adjust=False, schedule=planned, **arguments)
        super(SimiGrad, self).__init__(settings)  # SimiGrad's own __init__ takes a target; the rest is shared

    __init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("schedule", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            *inspect.signature(BatchSettings).parameters.values(),
        ]
    )
