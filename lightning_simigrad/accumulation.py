"""Variable-length accumulation windows inside Lightning's automatic optimization loop.

Lightning decides "step now?" with ``batch_progress.current.ready % accumulate_grad_batches == 0``
and "zero the gradients now?" with ``batch_idx % accumulate_grad_batches == 0``. Changing
``accumulate_grad_batches`` mid-epoch misplaces both boundaries (a window of 4 followed by one of
3 gives 4, 2, 4, ...: the previous window's gradient leaks into the next). So, for the length of a
fit, :class:`VariableAccumulation` replaces those two decisions on the loop *instances* with ones
read from the current window plan. Everything that follows from them in Lightning -- DDP's
``no_sync``, ``global_step``, LR-scheduler stepping, logging cadence -- then follows the windows.

The loss of each micro-batch is divided by ``trainer.accumulate_grad_batches``; this module sets it,
per micro-batch, to ``N / (W * n)`` for a micro-batch of ``n`` samples in a window of ``N`` samples on
``W`` ranks. The user's mean loss then weighs every sample of the window by exactly ``1 / N`` (after
DDP's division by ``W``), whatever the micro-batch sizes. A rank feeding a zero-weight padding sample
gets ``inf`` (the loss divided by it is 0).

The replaced methods are private; ``attach`` checks that they exist and the package pins Lightning's
minor version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from torch.optim import Optimizer

__all__ = ["VariableAccumulation"]


class VariableAccumulation:
    """Makes Lightning's accumulation boundaries and loss scale follow :attr:`window_start` / :attr:`window_end`."""

    def __init__(self) -> None:
        self.window_start = True
        self.window_end = True
        self._trainer: pl.Trainer | None = None
        self._user_accumulate_grad_batches: Any = 1

    def attach(self, trainer: pl.Trainer) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        automatic = epoch_loop.automatic_optimization
        for owner, name in (
            (epoch_loop, "_accumulated_batches_reached"),
            (automatic, "_make_zero_grad_fn"),
            (automatic, "_on_before_zero_grad"),
            (automatic, "_optimizer_zero_grad"),
        ):
            if not callable(getattr(owner, name, None)):
                raise RuntimeError(
                    f"SimiGrad needs `{type(owner).__name__}.{name}` of Lightning 2.6, which this Lightning"
                    f" ({pl.__version__}) lacks. Install `lightning>=2.6,<2.7`."
                )
        self._trainer = trainer
        self._user_accumulate_grad_batches = trainer.accumulate_grad_batches
        epoch_loop._accumulated_batches_reached = lambda: self.window_end  # type: ignore[method-assign]
        automatic._make_zero_grad_fn = self._make_zero_grad_fn  # type: ignore[method-assign]

    def detach(self) -> None:
        trainer = self._trainer
        if trainer is None:
            return
        epoch_loop = trainer.fit_loop.epoch_loop
        # deleting the instance attributes brings back the class's methods
        epoch_loop.__dict__.pop("_accumulated_batches_reached", None)
        epoch_loop.automatic_optimization.__dict__.pop("_make_zero_grad_fn", None)
        trainer.accumulate_grad_batches = self._user_accumulate_grad_batches
        self._trainer = None

    def set_micro_batch(self, start: bool, end: bool, loss_divisor: float) -> None:
        """Declare the micro-batch about to run: first/last of its window, and its loss divisor."""
        assert self._trainer is not None
        self.window_start = start
        self.window_end = end
        # an integral divisor stays an int, so code that reads the attribute sees what it expects
        self._trainer.accumulate_grad_batches = int(loss_divisor) if float(loss_divisor).is_integer() else loss_divisor  # type: ignore[assignment]

    def _make_zero_grad_fn(self, batch_idx: int, optimizer: Optimizer) -> Callable[[], None] | None:
        assert self._trainer is not None
        automatic = self._trainer.fit_loop.epoch_loop.automatic_optimization
        if automatic._skip_backward or not self.window_start:
            return None

        def zero_grad_fn() -> None:
            automatic._on_before_zero_grad(optimizer)
            automatic._optimizer_zero_grad(batch_idx, optimizer)

        return zero_grad_fn
