"""Where SimiGrad meets the other callbacks of a fit: the tuners, the order of hooks, the LR monitor.

- Lightning's tuners (``BatchSizeFinder``, ``LearningRateFinder``, and ``Tuner`` which adds them) run
  trial fits with every other callback removed. While one is attached SimiGrad stays out of the way,
  so the trials train at the DataLoader's own batch; it takes over when the tuner is done. A tuned
  batch size is the largest micro-batch that fits in memory: SimiGrad uses it as
  ``max_micro_batch_size``, while B0 stays the batch the learning rate was chosen for.
- SimiGrad runs its hooks before the other callbacks (tuners excepted), so they read the current
  micro-batch's window and learning rate whatever order the user listed them in.
- ``LearningRateMonitor`` reads ``param_groups`` between steps, where the scheduler's own value stays
  (schedulers read it back); :class:`AppliedLRMonitor` makes it report the learning rate the next
  optimizer step applies.

What SimiGrad refuses is in :mod:`~lightning_simigrad.integration.refusals`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BatchSizeFinder, Callback, LearningRateFinder, LearningRateMonitor
from lightning.pytorch.utilities.parsing import lightning_getattr

__all__ = ["AppliedLRMonitor", "batch_size_before_tuning", "run_before_other_callbacks", "tuners"]


def run_before_other_callbacks(trainer: pl.Trainer, callback: Callback) -> None:
    """Move ``callback`` ahead of every callback but the tuners (which must finish first).

    SimiGrad decides in ``on_train_batch_start`` which window a micro-batch belongs to, steps the schedules
    and sets the learning-rate factor; callbacks that read any of it (an LR monitor, a progress bar, the
    user's) then see the current micro-batch's values whatever order they were passed in. The list object
    is replaced, not changed in place, as Lightning may be iterating the old one.
    """
    others = [c for c in trainer.callbacks if c is not callback]  # type: ignore[attr-defined]
    first = [c for c in others if c in tuners(trainer)]
    trainer.callbacks = [*first, callback, *[c for c in others if c not in first]]  # type: ignore[attr-defined]


def tuners(trainer: pl.Trainer) -> list[Callback]:
    """The tuner callbacks attached to ``trainer`` (they run their trials in ``on_fit_start``)."""
    return [c for c in trainer.callbacks if isinstance(c, (BatchSizeFinder, LearningRateFinder))]  # type: ignore[attr-defined]


def batch_size_before_tuning(trainer: pl.Trainer, pl_module: pl.LightningModule) -> int | None:
    """The batch size a ``BatchSizeFinder`` is about to tune (where the finder will read it), or None."""
    for callback in tuners(trainer):
        if isinstance(callback, BatchSizeFinder):
            try:
                value = lightning_getattr(pl_module, callback._batch_arg_name)
            except AttributeError:
                return None  # the finder itself reports the missing attribute
            return int(value) if isinstance(value, int) else None
    return None


class AppliedLRMonitor:
    """Makes every ``LearningRateMonitor`` of a fit report ``lr x factor()`` (the factor of the next step)."""

    def __init__(self, factor: Callable[[], float]) -> None:
        self._factor = factor
        self._monitors: list[LearningRateMonitor] = []

    def attach(self, trainer: pl.Trainer) -> None:
        for monitor in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(monitor, LearningRateMonitor) and "_extract_lr" not in monitor.__dict__:
                extract = monitor._extract_lr

                def extract_applied(
                    param_group: dict[str, Any], name: str, extract: Callable[..., dict[str, Any]] = extract
                ) -> dict[str, Any]:
                    return extract({**param_group, "lr": param_group["lr"] * self._factor()}, name)

                monitor._extract_lr = extract_applied  # type: ignore[method-assign]
                self._monitors.append(monitor)

    def detach(self) -> None:
        for monitor in self._monitors:
            monitor.__dict__.pop("_extract_lr", None)
        self._monitors = []
