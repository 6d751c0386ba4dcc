"""The learning-rate factor that follows the batch size: the paper's :math:`\\sqrt{B/B_0}` (or :math:`B/B_0`,
or 1), blended as :math:`(\\text{factor} - 1) f + 1`. :mod:`lightning_simigrad.integration.lr_scaler` applies it
around each optimizer step."""

from __future__ import annotations

import math

__all__ = ["LR_SCALINGS", "lr_factor"]

LR_SCALINGS = ("sqrt", "linear", "none")


def lr_factor(batch_size: int, initial_batch_size: int, scaling: str = "sqrt", blend: float = 1.0) -> float:
    """The learning-rate multiplier for a step of ``batch_size`` samples.

    >>> lr_factor(400, 100)                       # sqrt(4)
    2.0
    >>> lr_factor(400, 100, "linear", blend=0.5)  # (4 - 1) * 0.5 + 1
    2.5
    """
    ratio = batch_size / initial_batch_size
    if scaling == "sqrt":
        factor = math.sqrt(ratio)
    elif scaling == "linear":
        factor = ratio
    elif scaling == "none":
        return 1.0
    else:
        raise ValueError(f"`lr_scaling` must be one of {LR_SCALINGS}, got {scaling!r}.")
    return (factor - 1.0) * blend + 1.0
