"""``simigrad=ramp``: a fixed batch-size ramp in place of the adaptive batch, from the recipes' ``simigrad`` group.

The experiments set SimiGrad's keys (its target, B0, bounds, micro-batch cap) in the ``simigrad`` group; a ramp
keeps those that apply to any batch and leaves the controller's aside, so every experiment runs with
``simigrad=ramp`` unchanged. ``ramp.start`` defaults to B0 (the batch the experiment's learning rate belongs to).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_simigrad import BatchSizeSchedule, doubling, linear_ramp
from lightning_simigrad.core.settings import BatchSettings
from lightning_simigrad_recipes.errors import RecipeError

KINDS = ("linear", "doubling")


def batch_size_ramp(
    kind: str,
    end: int | None = None,
    over: int | None = None,
    at: Sequence[int] = (),
    start: int | None = None,
    **simigrad: Any,
) -> BatchSizeSchedule:
    """A :class:`~lightning_simigrad.BatchSizeSchedule` of a linear ramp (``start`` to ``end`` over ``over``
    samples) or doublings (``start``, doubled at each sample count of ``at``); ``simigrad``: the group's other keys."""
    shared = {k: v for k, v in simigrad.items() if k in BatchSettings.__dataclass_fields__}
    start = start or shared.get("initial_batch_size")
    if start is None:
        raise RecipeError("simigrad=ramp needs simigrad.start or simigrad.initial_batch_size (B0): set one")
    if kind == "linear":
        if end is None or over is None:
            raise RecipeError(f"simigrad.kind=linear needs simigrad.end and simigrad.over (got {end}, {over})")
        try:
            schedule = linear_ramp(start=int(start), end=int(end), over=int(over))
        except ValueError as error:
            raise RecipeError(f"simigrad=ramp: {error}") from error
    elif kind == "doubling":
        try:
            schedule = doubling(int(start), at=[int(p) for p in at])
        except ValueError as error:
            raise RecipeError(f"simigrad=ramp: {error}") from error
    else:
        raise RecipeError(f"simigrad.kind={kind!r}: one of {', '.join(KINDS)}")
    return BatchSizeSchedule(schedule, **shared)
