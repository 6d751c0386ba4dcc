"""The learning-rate factor applied around ``optimizer.step`` only.

:class:`StepLRScaler` multiplies every param group's ``lr`` by the step's factor
(:func:`lightning_simigrad.core.lr_scaling.lr_factor`) in an optimizer *step pre-hook* and restores the exact
saved value in the *post-hook*, so the user's LR scheduler only ever sees (and steps) its own values, and the
gradients are untouched. Multiplying in ``on_before_optimizer_step`` and dividing after the batch would be
wrong: the scheduler steps in between.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

__all__ = ["StepLRScaler"]


class StepLRScaler:
    """Scales the learning rate of an optimizer by :attr:`factor` for the duration of each ``step``."""

    def __init__(self) -> None:
        self.factor = 1.0
        self._saved: list[Any] = []
        self._stepping = False
        self._optimizer: Optimizer | None = None
        self._handles: list[RemovableHandle] = []

    def attach(self, optimizer: Optimizer) -> None:
        self._optimizer = optimizer
        self._handles += [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._optimizer = None

    def rescale(self, factor: float) -> None:
        """Change the factor, also for a step under way (its closure runs between the pre- and post-hook).

        Lightning passes the closure (forward and backward) into ``optimizer.step``, so the pre-hook runs
        before the last micro-batch of the window; a step that turns out to average fewer samples than
        planned (a skipped micro-batch) gets its factor corrected here, before the parameters move.
        """
        self.factor = factor
        if self._stepping and self._optimizer is not None:
            for group, lr in zip(self._optimizer.param_groups, self._saved):
                group["lr"] = lr * factor if factor != 1.0 else lr

    def applied_lr(self) -> float:
        """The learning rate of the first param group as the current (or next) step applies it."""
        if self._optimizer is None:
            return float("nan")
        base = self._saved[0] if self._stepping else self._optimizer.param_groups[0]["lr"]
        return float(base) * self.factor

    def _pre_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self._saved = [group["lr"] for group in optimizer.param_groups]
        self._stepping = True
        if self.factor != 1.0:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * self.factor

    def _post_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        for group, lr in zip(optimizer.param_groups, self._saved):
            group["lr"] = lr  # the very object saved, so the scheduler's value comes back bit for bit
        self._stepping = False
