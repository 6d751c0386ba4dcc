"""Variable-length accumulation windows inside Lightning's automatic optimization loop.

Lightning decides "step now?" with ``batch_progress.current.ready % accumulate_grad_batches == 0``
and "zero the gradients now?" with ``batch_idx % accumulate_grad_batches == 0``. Changing
``accumulate_grad_batches`` mid-epoch misplaces both boundaries (a window of 4 followed by one of
3 gives 4, 2, 4, ...: the previous window's gradient leaks into the next). So, for the length of a
fit, :class:`VariableAccumulation` replaces those two decisions on the loop *instances* with ones
read from the current window plan. Everything that follows from them in Lightning -- DDP's and FSDP1's
``no_sync``, ``global_step``, LR-scheduler stepping, logging cadence -- then follows the windows. A
measurement that needs the gradient reduced at a window's midpoint too (FSDP1's,
:func:`~lightning_simigrad.measurement.midpoint_reduction`) gets that one backward out of ``no_sync``: the
strategy's public ``block_backward_sync`` is wrapped on the instance for the fit. An
epoch that runs no backward (``fit_loop._skip_backward``: ``StochasticWeightAveraging``'s BatchNorm
epoch) accumulates throughout, so nothing steps in it.

Lightning divides each micro-batch's loss by ``trainer.accumulate_grad_batches``. Here the divisor is
``N / (W * n)`` for a micro-batch of ``n`` samples in a window of ``N`` samples on ``W`` ranks, so the
user's mean loss weighs every sample of the window by exactly ``1 / N`` (after DDP's division by
``W``), whatever the micro-batch sizes; a rank feeding a zero-weight padding sample divides by ``inf``.
That divisor is applied where Lightning builds the closure's result (its ``output_result_cls``), and
``trainer.accumulate_grad_batches`` reads what users expect of it: the current window's number of
micro-batches, an int. The detached loss handed to callbacks (``outputs["loss"]``) stays undivided: the
micro-batch's own mean loss, as plain Lightning gives it without accumulation.

Under DeepSpeed (``strategy.handles_gradient_accumulation``) Lightning runs ``optimizer_step`` after every
micro-batch and the engine decides when to step: the measurement, which drives the engine, sets its accumulation
boundary before every micro-batch from the window (:mod:`~lightning_simigrad.measurement.zero_partitions`), with
``gradient_accumulation_steps`` 1 so that the engine divides no gradient (the refusals check it), and Lightning's
counts follow the windows as above.

The replaced methods are private: :mod:`lightning_simigrad._compat` lists them and checks that they exist
when a fit starts, and the package pins Lightning's minor version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from torch.optim import Optimizer

__all__ = ["VariableAccumulation"]


class VariableAccumulation:
    """Makes Lightning's accumulation boundaries and loss scale follow :attr:`window_start` / :attr:`window_end`."""

    def __init__(self) -> None:
        self.window_start = True
        self.window_end = True
        self.loss_divisor = 1.0
        self.reduces = False  # the current micro-batch's backward reduces though its window goes on
        self._trainer: pl.Trainer | None = None
        self._user_accumulate_grad_batches: Any = 1
        self._set_length: Any = 1  # what `trainer.accumulate_grad_batches` was last set to here (or the user's)

    def attach(self, trainer: pl.Trainer) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        automatic = epoch_loop.automatic_optimization
        self._trainer = trainer
        self._user_accumulate_grad_batches = self._set_length = trainer.accumulate_grad_batches
        epoch_loop._accumulated_batches_reached = lambda: self.window_end  # type: ignore[method-assign]
        should_accumulate = epoch_loop._should_accumulate
        # An epoch that runs no backward has nothing to step. StochasticWeightAveraging's BatchNorm epoch is one: it
        # makes the epoch a single window (`accumulate_grad_batches = max_batches`) that SimiGrad's windows replace,
        # and even that one window Lightning steps at the epoch's end, on the gradient the previous step left.
        epoch_loop._should_accumulate = (  # type: ignore[method-assign]
            lambda: bool(automatic._skip_backward) or should_accumulate()
        )
        automatic._make_zero_grad_fn = self._make_zero_grad_fn  # type: ignore[method-assign]
        automatic.output_result_cls = _WindowWeightedResult(self)  # type: ignore[assignment]
        block = getattr(trainer.strategy, "block_backward_sync", None)  # a parallel strategy's
        if block is not None:

            @contextmanager
            def block_unless_reducing() -> Iterator[None]:
                if self.reduces:
                    yield None
                else:
                    with block():
                        yield None

            trainer.strategy.block_backward_sync = block_unless_reducing  # type: ignore[attr-defined]

    def detach(self) -> None:
        trainer = self._trainer
        if trainer is None:
            return
        epoch_loop = trainer.fit_loop.epoch_loop
        # deleting the instance attributes brings back the class's methods
        epoch_loop.__dict__.pop("_accumulated_batches_reached", None)
        epoch_loop.__dict__.pop("_should_accumulate", None)
        epoch_loop.automatic_optimization.__dict__.pop("_make_zero_grad_fn", None)
        epoch_loop.automatic_optimization.__dict__.pop("output_result_cls", None)
        trainer.strategy.__dict__.pop("block_backward_sync", None)
        trainer.accumulate_grad_batches = self._user_accumulate_grad_batches
        self._trainer = None

    def set_micro_batch(
        self, start: bool, end: bool, loss_divisor: float, window_length: int, reduces: bool = False
    ) -> None:
        """Declare the micro-batch about to run: first/last of its window, its loss divisor, the
        window's number of micro-batches, and whether its backward must reduce though the window goes on.

        Raises:
            RuntimeError: when something else (a callback's own accumulation schedule) changed
                ``trainer.accumulate_grad_batches`` since: SimiGrad would silently override it. An epoch without
                backward (StochasticWeightAveraging's BatchNorm epoch, which sets it) is served.
        """
        trainer = self._trainer
        assert trainer is not None
        value = trainer.accumulate_grad_batches
        if value != self._set_length and not trainer.fit_loop.epoch_loop.automatic_optimization._skip_backward:
            raise RuntimeError(
                f"`trainer.accumulate_grad_batches` was set to {value!r} during the fit (epoch"
                f" {trainer.current_epoch}), by a callback or the LightningModule; SimiGrad sets every window's"
                " accumulation itself and would override it. Remove what sets it (SimiGrad accumulates as many"
                " micro-batches as a window needs; bound a micro-batch's memory with `max_micro_batch_size`)."
            )
        self._set_length = window_length
        self.window_start, self.window_end, self.loss_divisor, self.reduces = start, end, loss_divisor, reduces
        trainer.accumulate_grad_batches = window_length

    def _make_zero_grad_fn(self, batch_idx: int, optimizer: Optimizer) -> Callable[[], None] | None:
        assert self._trainer is not None
        automatic = self._trainer.fit_loop.epoch_loop.automatic_optimization
        if automatic._skip_backward or not self.window_start:
            return None

        def zero_grad_fn() -> None:
            automatic._on_before_zero_grad(optimizer)
            automatic._optimizer_zero_grad(batch_idx, optimizer)

        return zero_grad_fn


class _WindowWeightedResult:
    """Stands in for Lightning's ``ClosureResult`` class: builds it with the window's loss divisor."""

    def __init__(self, accumulation: VariableAccumulation) -> None:
        self._accumulation = accumulation

    def from_training_step_output(self, training_step_output: Any, normalize: int = 1) -> ClosureResult:
        # built undivided, so that its detached `loss` (what callbacks get as `outputs["loss"]`, and the closure
        # returns to the optimizer) is the micro-batch's own mean loss, as plain Lightning hands it without
        # accumulation: the window's weight varies from window to window (a short tail window looks like a spike
        # to `SpikeDetection`). Only the loss the backward runs on carries the weight.
        result = ClosureResult.from_training_step_output(training_step_output)
        if result.closure_loss is not None:
            result.closure_loss = result.closure_loss / self._accumulation.loss_divisor
        return result
