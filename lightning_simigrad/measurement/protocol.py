r"""What a measurement of the two half-batch gradients does, whatever it measures on.

A :class:`Measurement` is told about every micro-batch of a window and hands back, once per window, the
statistics of the window's two halves :math:`g_A` and :math:`g_B` (:class:`~lightning_simigrad.HalfStats`),
or None when the window had no two halves to compare. The run (:class:`lightning_simigrad.run.Run`) calls,
for each window:

1. :meth:`~Measurement.start_micro_batch` before each micro-batch's forward;
2. :meth:`~Measurement.after_backward` after each micro-batch's backward (before a GradScaler unscales);
3. :meth:`~Measurement.collect` once, before the optimizer step: the statistics, with the loss scale the
   backward ran under taken out of them; the gradients are left exactly as plain training leaves them;
4. :meth:`~Measurement.abort` instead of ``collect`` when the window is abandoned (an epoch or fit ended
   inside it): nothing of it may leak into the next window;

and :meth:`~Measurement.close` when the fit ends. The implementations:

- :class:`~lightning_simigrad.measurement.window_halves.WindowHalvesMeasurement`: one process, the window's
  two halves in time;
- :class:`~lightning_simigrad.measurement.rank_groups.RankGroupMeasurement`: DDP, two groups of ranks,
  inside the communication hook;
- :class:`~lightning_simigrad.measurement.sharded_halves.ShardedHalvesMeasurement`: FSDP2, the window's
  halves in time on every rank's gradient shards;
- :class:`~lightning_simigrad.measurement.two_stage_reduce_scatter.TwoStageReduceScatterMeasurement`: FSDP1 on
  an even number of ranks, two groups of ranks inside a two-stage reduce-scatter;
- :class:`~lightning_simigrad.measurement.midpoint_reduction.MidpointReductionMeasurement`: FSDP1 on an odd
  number, the halves in time, with the gradient reduced at the window's midpoint too.

A new measurement (a fused device kernel, say) implements these five methods, ``min_micro_batches`` and
``midpoint_reduction``; the run and the callback do not change. Every measurement reads the loss scale the same
way, through :func:`loss_scale_of`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from lightning_simigrad import _compat
from lightning_simigrad.core.plan import Window
from lightning_simigrad.core.statistics import HalfStats

__all__ = ["LossScale", "Measurement", "MeasurementError", "loss_scale_of"]

LossScale = Tensor | float | None  # the loss scale as it stands, a tensor left on its device where it is one


class MeasurementError(RuntimeError):
    """A measurement failed on some rank. Under DDP every rank raises it, with the same message, at the same step."""


MeasurementError.__module__ = "lightning_simigrad"  # exported there; tracebacks name it where users import it


@runtime_checkable
class Measurement(Protocol):
    """Measures the half-batch gradients of each window (see the module docstring for the call order)."""

    min_micro_batches: int  # the fewest micro-batches per rank a window needs for two halves
    # the last backward of a window's first half must reduce the gradient across ranks (leave DDP/FSDP1 `no_sync`)
    midpoint_reduction: bool

    def start_micro_batch(self, window: Window, index: int, params: Sequence[Tensor]) -> None:
        """Micro-batch ``index`` of ``window`` is about to run its forward and backward."""

    def after_backward(self, window: Window, index: int, fed: tuple[int, int], params: Sequence[Tensor]) -> None:
        """Micro-batch ``index`` has run its backward; ``fed`` counts the samples each half has fed so far."""

    def collect(self, loss_scale: LossScale) -> HalfStats | None:
        """The window's statistics (None: nothing measured), the gradients left as plain training leaves them."""

    def abort(self) -> None:
        """The window was abandoned: forget it, leaving the gradients as plain training leaves them."""

    def close(self) -> None:
        """The fit is over: release what the measurement holds."""


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
