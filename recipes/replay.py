"""``simigrad=replay``: a finished run's batch sizes replayed, from the recipes' ``simigrad`` group.

Learn once, replay: ``simigrad.trace`` names a run's ``simigrad_trace.csv`` (or its run directory, or a W&B export,
or a schedule YAML written by ``simigrad-trace --schedule``), and ``BatchSizeSchedule.from_trace`` trains on its
batch sizes with no controller. The experiments set SimiGrad's keys in the ``simigrad`` group; a replay keeps those
that apply to any batch (B0, micro-batch cap, ``lengths``, ``loss_items``, LR scaling, ``max_samples``) so that
every experiment runs with ``simigrad=replay`` unchanged, and leaves aside the controller's and the bounds: the
recorded run kept to its bounds, and its epochs' tails, which may lie below them, are replayed as they were.
"""

from __future__ import annotations

from typing import Any

from lightning_simigrad import BatchSizeSchedule
from lightning_simigrad.core.settings import BatchSettings
from lightning_simigrad_recipes.errors import RecipeError

_BOUNDS = ("min_batch_size", "max_batch_size")


def replay_schedule(
    trace: str | None = None, smooth: int | None = None, snap: str | None = None, **simigrad: Any
) -> BatchSizeSchedule:
    """A :class:`~lightning_simigrad.BatchSizeSchedule` replaying ``trace``, its trajectory smoothed over ``smooth``
    steps (an odd number; a running median) and snapped to doublings of B0 with ``snap="doubling"``; ``simigrad``:
    the group's other keys."""
    if not trace:
        raise RecipeError(
            "simigrad=replay needs simigrad.trace=PATH: a run's simigrad_trace.csv (or its run directory), a W&B"
            " export of its simigrad/* metrics, or a schedule YAML from `simigrad-trace TRACE --schedule out.yaml`"
        )
    shared = {k: v for k, v in simigrad.items() if k in BatchSettings.__dataclass_fields__ and k not in _BOUNDS}
    try:
        return BatchSizeSchedule.from_trace(str(trace), smooth=smooth, snap=snap, **shared)
    except (OSError, ValueError) as error:
        raise RecipeError(f"simigrad=replay: {error}") from error
