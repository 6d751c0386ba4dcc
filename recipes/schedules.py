"""Learning-rate schedules over the whole fit, for the recipes' step-interval schedulers.

Each builder takes the optimizer and ``total_steps``: the fit's length in steps, which the recipes' modules
read from ``trainer.estimated_stepping_batches``. With SimiGrad that is the number of steps a run at the
fixed batch B0 takes, and SimiGrad advances the schedule by ``B / B0`` per step of B samples, so the same
config runs the schedule once over the fit with a static or an adaptive batch.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from lightning_simigrad_recipes.errors import RecipeError


def _check(total_steps: float, warmup_fraction: float) -> int:
    if not math.isfinite(total_steps) or total_steps <= 0:
        raise RecipeError(
            f"a schedule over the fit needs a bounded fit; trainer.estimated_stepping_batches is {total_steps}."
            " Set trainer.max_epochs or trainer.max_steps, or use scheduler=none"
        )
    if not 0.0 <= warmup_fraction < 1.0:
        raise RecipeError(f"scheduler.warmup_fraction must lie in [0, 1), got {warmup_fraction}")
    return int(total_steps)


def warmup_linear(
    optimizer: torch.optim.Optimizer, total_steps: float, warmup_fraction: float = 0.01, final_fraction: float = 0.0
) -> LambdaLR:
    """Linear warm-up over ``warmup_fraction`` of the fit, then linear decay to ``final_fraction`` of the LR.

    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> schedule = warmup_linear(opt, total_steps=10, warmup_fraction=0.2)
    >>> [round(schedule.lr_lambdas[0](step), 3) for step in (0, 1, 2, 6, 10)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    total = _check(total_steps, warmup_fraction)
    warmup = round(total * warmup_fraction)

    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        return final_fraction + (1.0 - final_fraction) * max(0.0, (total - step) / max(1, total - warmup))

    return LambdaLR(optimizer, factor)


def warmup_cosine(
    optimizer: torch.optim.Optimizer, total_steps: float, warmup_fraction: float = 0.0, final_fraction: float = 0.0
) -> LambdaLR:
    """Linear warm-up over ``warmup_fraction`` of the fit, then cosine decay to ``final_fraction`` of the LR.

    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> schedule = warmup_cosine(opt, total_steps=10)
    >>> [round(schedule.lr_lambdas[0](step), 3) for step in (0, 5, 10)]
    [1.0, 0.5, 0.0]
    """
    total = _check(total_steps, warmup_fraction)
    warmup = round(total * warmup_fraction)

    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return final_fraction + (1.0 - final_fraction) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)
