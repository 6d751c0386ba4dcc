"""SimiGrad's settings, validated once, when the callback is made (before any Trainer exists).

>>> Settings(target_similarity=0.8).controller_args(initial_batch_size=64, min_batch_size=2)["min_batch_size"]
2
>>> Settings(target_similarity=0.8, lr_scaling="cubic")
Traceback (most recent call last):
...
ValueError: `lr_scaling` must be one of ('sqrt', 'linear', 'none'), got 'cubic'.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lightning_simigrad.core.controller import BatchSizeController
from lightning_simigrad.core.lr_scaling import LR_SCALINGS

__all__ = ["Settings"]


@dataclass(frozen=True)
class Settings:
    """The arguments of :class:`~lightning_simigrad.SimiGrad` (documented there)."""

    target_similarity: float
    min_batch_size: int | None = None
    max_batch_size: int | None = None
    max_micro_batch_size: int | None = None
    adjust: bool = True
    lr_scaling: str = "sqrt"
    lr_scaling_blend: float = 1.0
    controller: str = "paper"
    initial_batch_size: int | None = None
    grow_factor: float = 1.1
    shrink_factor: float = 0.9
    smoothing: float = 0.0
    noise_scale_decay: float = 0.9
    deadband: float = 0.0
    warmup_steps: int = 0
    schedule_by_samples: bool = True
    max_samples: int | None = None
    progress_bar: bool = True
    history_size: int | None = 10_000

    def __post_init__(self) -> None:
        if self.lr_scaling not in LR_SCALINGS:
            raise ValueError(f"`lr_scaling` must be one of {LR_SCALINGS}, got {self.lr_scaling!r}.")
        blend = self.lr_scaling_blend
        if not (isinstance(blend, (int, float)) and 0.0 <= blend <= 1.0):
            raise ValueError(f"`lr_scaling_blend` must lie in [0, 1], got {blend!r}. Use 1 for the full factor.")
        for name in ("max_micro_batch_size", "initial_batch_size", "max_samples"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"`{name}` must be a positive int or None, got {value!r}.")
        size = self.history_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise ValueError(
                f"`history_size` must be a non-negative int or None, got {size!r}. Use None to keep every"
                " step, 0 to keep none."
            )
        # the controller checks the rest of its own arguments
        BatchSizeController(**self.controller_args(self.initial_batch_size or self.min_batch_size or 1))

    def controller_args(self, initial_batch_size: int, min_batch_size: int | None = None) -> dict[str, Any]:
        """The :class:`BatchSizeController` arguments, with B0 and the smallest batch a measurement needs."""
        own = asdict(self)
        args = {name: own[name] for name in _CONTROLLER_ARGS}
        args["rule"] = self.controller
        if min_batch_size is not None:
            args["min_batch_size"] = max(args["min_batch_size"] or 1, min_batch_size)
        return {"initial_batch_size": initial_batch_size, **args}


_CONTROLLER_ARGS = (
    "target_similarity",
    "min_batch_size",
    "max_batch_size",
    "grow_factor",
    "shrink_factor",
    "smoothing",
    "noise_scale_decay",
    "deadband",
    "warmup_steps",
)
