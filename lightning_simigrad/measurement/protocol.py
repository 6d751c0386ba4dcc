r"""What a measurement of the two half-batch gradients does, whatever it measures on.

A :class:`Measurement` is told about every micro-batch of a window and hands back, once per window, the
statistics of the window's two halves :math:`g_A` and :math:`g_B` (:class:`~lightning_simigrad.HalfStats`),
or None when the window had no two halves to compare. The run (:class:`lightning_simigrad.run.Run`) calls,
for each window:

1. :meth:`~Measurement.start_micro_batch` before each micro-batch's forward;
2. :meth:`~Measurement.after_backward` after each micro-batch's backward (before a GradScaler unscales);
3. :meth:`~Measurement.collect` once, before the optimizer step: the statistics, with the loss scale the
   backward ran under taken out of them; the gradients are left exactly as plain training leaves them. The numbers
   the run declares (:class:`Columns`: a step's loss items) cross ranks in the same exchange;
4. :meth:`~Measurement.abort` instead of ``collect`` when the window is abandoned (an epoch or fit ended
   inside it): nothing of it may leak into the next window;

:meth:`~Measurement.attach` once when training starts, on the model as the strategy wrapped it (the measurement
checks it and hooks itself in where it measures inside a reduction), and :meth:`~Measurement.close` when the fit
ends. Where the strategy keeps the gradient the optimizer steps with elsewhere than ``p.grad`` (DeepSpeed's ZeRO
partitions), the measurement says where (``gradients(params)``, read through :func:`gradients_of`): a rescaling of
the step's gradient (``loss_items``'s) multiplies those tensors. Every measurement is a composition
(:mod:`~lightning_simigrad.measurement.composed`) of what its halves are (halves in time, two groups of ranks) and
how their products cross ranks
(:mod:`~lightning_simigrad.measurement.rows`); :mod:`~lightning_simigrad.measurement.factory` picks the one a
strategy needs. Every measurement reads the loss scale the same way, through :func:`loss_scale_of`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from lightning_simigrad import _compat
from lightning_simigrad.core.plan import Window
from lightning_simigrad.core.statistics import HalfStats

__all__ = ["Attachment", "Columns", "LossScale", "Measurement", "MeasurementError", "gradients_of", "loss_scale_of"]

LossScale = Tensor | float | None  # the loss scale as it stands, a tensor left on its device where it is one


class MeasurementError(RuntimeError):
    """A measurement failed on some rank. Under DDP every rank raises it, with the same message, at the same step."""


MeasurementError.__module__ = "lightning_simigrad"  # exported there; tracebacks name it where users import it


@dataclass
class Columns:
    """Numbers a step's rows carry beside the measurement's, declared by the run: this rank's ``local`` ones, and,
    once :meth:`Measurement.collect` has read the rows, their ``totals`` over every rank that gathered them (summed in
    rank order: alike on every rank)."""

    local: tuple[float, ...]
    totals: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Attachment:
    """The model a measurement attaches to when training starts.

    Args:
        model: the model as the strategy wrapped it (a ``DistributedDataParallel``, the FSDP1 root, or the module).
        params: the LightningModule's parameters, as the optimizer sees them.
        data_parallel_size: ranks that feed samples of their own.
    """

    model: Any
    params: Sequence[Tensor]
    data_parallel_size: int


@runtime_checkable
class Measurement(Protocol):
    """Measures the half-batch gradients of each window (see the module docstring for the call order)."""

    @property
    def name(self) -> str:
        """What it measures on, for messages ("one-process", "DDP", "FSDP")."""

    @property
    def min_micro_batches(self) -> int:
        """The fewest micro-batches per rank a window needs for two halves (2 in time, 1 for rank groups)."""

    @property
    def midpoint_reduction(self) -> bool:
        """The last backward of a window's first half must reduce the gradient across ranks (leave ``no_sync``)."""

    def attach(self, target: Attachment) -> None:
        """Training starts on ``target``: check it, and hook in where the measurement needs to."""

    def start_micro_batch(self, window: Window, index: int, params: Sequence[Tensor]) -> None:
        """Micro-batch ``index`` of ``window`` is about to run its forward and backward."""

    def after_backward(self, window: Window, index: int, fed: tuple[int, int], params: Sequence[Tensor]) -> None:
        """Micro-batch ``index`` has run its backward; ``fed`` counts the samples each half has fed so far."""

    def half_of(self, window: Window, index: int) -> int:
        """Which half this rank's micro-batch ``index`` of ``window`` feeds: 0 (A) or 1 (B)."""

    def collect(self, loss_scale: LossScale, columns: Columns | None = None) -> HalfStats | None:
        """The window's statistics (None: nothing measured), the gradients left as plain training leaves them; with
        ``columns``, their totals over the ranks are set in the same exchange (and on one process, as they are)."""

    def abort(self) -> None:
        """The window was abandoned: forget it, leaving the gradients as plain training leaves them."""

    def close(self) -> None:
        """The fit is over: release what the measurement holds."""


def gradients_of(measurement: Any, params: Sequence[Tensor]) -> list[Tensor]:
    """The tensors that hold the gradient the optimizer steps with: where a measurement that knows says so
    (``measurement.gradients(params)``: DeepSpeed's ZeRO partitions), else the parameters' ``grad``."""
    where = getattr(measurement, "gradients", None)
    return list(where(params)) if where is not None else [p.grad for p in params if p.grad is not None]


def loss_scale_of(scaler: Any) -> LossScale:
    """The loss scale of a ``GradScaler`` (or a tensor, a float, None) without reading it to the host.

    >>> loss_scale_of(None) is None, loss_scale_of(1024.0)
    (True, 1024.0)
    """
    if scaler is None or isinstance(scaler, (Tensor, float, int)):
        return scaler
    if not scaler.is_enabled():
        return None
    scale = _compat.scaler_scale(scaler)
    return scale if scale is not None else float(scaler.get_scale())
