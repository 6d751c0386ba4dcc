r"""A measurement, composed: what its two halves are, and how their products cross ranks.

Every measurement is a :class:`ComposedMeasurement` of two parts:

- its **halves** (a :class:`Halves`): what :math:`g_A` and :math:`g_B` are and where their shares' products are
  taken -- the window's halves in time on one process or on every rank's gradient shards
  (:mod:`~lightning_simigrad.measurement.time_halves`), or two groups of ranks inside a reduction (DDP's
  communication hook, :mod:`~lightning_simigrad.measurement.rank_groups`; FSDP1's reduce-scatter,
  :mod:`~lightning_simigrad.measurement.reduce_scatter_groups`);
- its **exchange** (:class:`~lightning_simigrad.exchange.Rows`): none on one process, one all-gather of a row per
  rank otherwise, with the failure protocol every rank follows alike (:mod:`~lightning_simigrad.measurement.rows`).
  The run may declare more numbers for the row to carry (:class:`~lightning_simigrad.measurement.protocol.Columns`): a
  step still costs one exchange.

The halves leave, at the window's end, up to four products of the two halves' *shares* :math:`a` and :math:`b` of
the window's gradient :math:`g = a + b` (each sample weighed by :math:`1 / N`), and say how the summed products
give :math:`a \cdot a`, :math:`a \cdot b`, :math:`b \cdot b` (:meth:`Halves.shares`). With :math:`n_A` and
:math:`n_B` samples behind them, :math:`g_A = (N / n_A)\,a` and :math:`g_B = (N / n_B)\,b` (:func:`halves_of`).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from lightning_simigrad.core.plan import Window
from lightning_simigrad.core.statistics import HalfStats
from lightning_simigrad.exchange import Rows
from lightning_simigrad.measurement.protocol import (
    Attachment,
    Columns,
    LossScale,
    MeasurementError,
    gradients_of,
    loss_scale_of,
)
from lightning_simigrad.measurement.rows import Outcome, failed_row, row, verdict

__all__ = ["ComposedMeasurement", "Finished", "Halves", "MeasurementSkipped", "halves_of"]


class MeasurementSkipped(UserWarning):
    """A step went unmeasured (a rank ran out of memory for the measurement); training went on."""


@dataclass(frozen=True)
class Finished:
    """What the halves leave on this rank at the window's end.

    Args:
        products: up to four products of the halves' shares, on the device (None: none on this rank).
        items: ``(n_A, n_B, N)``, the samples behind each half and the window's, the same on every rank.
        stage: where the measurement stands on this rank (:class:`~lightning_simigrad.measurement.rows.Outcome`).
        missing: gradient buckets whose products are missing.
        cause: the error behind a failure stage, chained to the error every rank raises.
    """

    products: Tensor | None
    items: tuple[int, int, int] | None
    stage: Outcome = Outcome.OK
    missing: int = 0
    cause: BaseException | None = None


class Halves(Protocol):
    """What a window's two halves are, and the products of their shares this rank takes."""

    name: str
    min_micro_batches: int
    midpoint_reduction: bool

    def attach(self, target: Attachment) -> None: ...

    def start_micro_batch(self, window: Window, index: int, params: Sequence[Tensor]) -> None: ...

    def after_backward(self, window: Window, index: int, fed: tuple[int, int], params: Sequence[Tensor]) -> None: ...

    def half_of(self, window: Window, index: int) -> int:
        """Which half this rank's micro-batch ``index`` feeds (0: A, 1: B)."""

    def finish(self) -> Finished | None:
        """The window's products on this rank; None when no rank measures this window (nothing is exchanged)."""

    def after_read(self) -> None:
        """The products were read to the host: what they read can be released."""

    def shares(self, sums: tuple[float, float, float, float]) -> tuple[float, float, float]:
        """``(a.a, a.b, b.b)`` from the products summed over the ranks."""

    def abort(self) -> None: ...

    def close(self) -> None: ...


class ComposedMeasurement:
    """A :class:`~lightning_simigrad.measurement.protocol.Measurement` made of :class:`Halves` and an exchange.

    Where the rows cross ranks, an error inside the halves' work on one rank never skips the exchange: it travels
    in that rank's row, and every rank raises the same :class:`~lightning_simigrad.MeasurementError` in
    :meth:`collect`. On one process the error is raised where it happens.
    """

    def __init__(self, halves: Halves, exchange: Rows, rank: int = 0) -> None:
        self.halves, self.exchange, self.rank = halves, exchange, rank
        self._failure: tuple[Outcome, BaseException] | None = None

    @property
    def name(self) -> str:
        return self.halves.name

    @property
    def min_micro_batches(self) -> int:
        return self.halves.min_micro_batches

    @property
    def midpoint_reduction(self) -> bool:
        return self.halves.midpoint_reduction

    def attach(self, target: Attachment) -> None:
        self.halves.attach(target)

    def start_micro_batch(self, window: Window, index: int, params: Sequence[Tensor]) -> None:
        if index == 0:
            self._failure = None  # a window the loop abandoned: nothing of it is reported
        self.halves.start_micro_batch(window, index, params)

    def after_backward(self, window: Window, index: int, fed: tuple[int, int], params: Sequence[Tensor]) -> None:
        self._guarded(Outcome.COMBINE, self.halves.after_backward, window, index, fed, params)

    def half_of(self, window: Window, index: int) -> int:
        return self.halves.half_of(window, index)

    def gradients(self, params: Sequence[Tensor]) -> list[Tensor]:
        """The tensors that hold the gradient the optimizer steps with: ``p.grad``, unless the halves keep it
        elsewhere and say so (DeepSpeed's ZeRO partitions)."""
        return gradients_of(self.halves, params)

    def collect(self, loss_scale: LossScale = None, columns: Columns | None = None) -> HalfStats | None:
        failure, self._failure = self._failure, None
        try:
            finished = self.halves.finish()
        except Exception as error:
            if not self.exchange.collective:
                raise
            failure = failure or (Outcome.COLLECT, error)
            finished = Finished(None, None)
        if not self.exchange.collective and columns is not None:
            columns.totals = columns.local  # one process: nothing crosses
        if finished is None and failure is None and (columns is None or not self.exchange.collective):
            return None  # no rank measures this window, and the run's columns need no exchange
        if not self.exchange.collective and (finished is None or finished.products is None):
            return None  # one process, nothing to compare
        local = self._row(finished, failure, columns.local if columns is not None else ())
        rows, scale = self.exchange.gather(local, loss_scale_of(loss_scale))
        self.halves.after_read()
        cause = failure[1] if failure is not None else (finished.cause if finished is not None else None)
        try:
            found = verdict(rows, self.name)
        except MeasurementError as error:
            raise error from cause
        if columns is not None:
            columns.totals = found.columns
        items = finished.items if finished is not None else None
        if found.skipped:
            self._warn_skipped(found.skipped)
            n_a, n_b, _ = items if items is not None else (0, 0, 0)
            return HalfStats(dot=math.nan, sq_a=math.nan, sq_b=math.nan, n_a=n_a, n_b=n_b)
        if found.sums is None or items is None:
            return None
        aa, ab, bb = self.halves.shares(found.sums)
        return halves_of(aa, ab, bb, *items, scale)

    def abort(self) -> None:
        self._failure = None  # every rank abandons the window alike: nothing of it is reported
        self.halves.abort()

    def close(self) -> None:
        self._failure = None
        self.halves.close()

    # ------------------------------------------------------------------------------ internals
    def _guarded(self, stage: Outcome, call: Callable[..., None], *args: Any) -> None:
        if not self.exchange.collective:
            call(*args)
            return
        try:
            call(*args)
        except Exception as error:  # reported to every rank by collect(), whose exchange every rank reaches
            if self._failure is None:
                self._failure = (stage, error)
            # the window is void (every rank raises before the optimizer steps); giving the first half back may
            # meet the same fault, and must not hide it
            with contextlib.suppress(Exception):
                self.halves.abort()

    def _row(
        self, finished: Finished | None, failure: tuple[Outcome, BaseException] | None, columns: Sequence[float]
    ) -> Tensor:
        products = finished.products if finished is not None else None
        device = products.device if products is not None else None
        if failure is not None:
            return failed_row(device, failure[0], columns)
        if finished is None:  # nothing measured on any rank: the row carries the run's columns alone
            return row(None, Outcome.UNMEASURED, device=device, columns=columns)
        if finished.stage > 0:
            return failed_row(device, finished.stage, columns)
        stage = finished.stage if products is not None or finished.stage != Outcome.OK else Outcome.UNMEASURED
        return row(products, stage, finished.missing, device=device, columns=columns)

    def _warn_skipped(self, ranks: list[int]) -> None:
        if self.rank != 0:  # one warning for the whole group
            return
        warnings.warn(
            f"SimiGrad skipped this step's {self.name} measurement: rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))} ran out of device memory preparing or finishing it. The gradients "
            "are the strategy's own, the batch size holds and training goes on. If it recurs, lower "
            "`max_micro_batch_size` or DDP's `bucket_cap_mb` (the measurement holds up to one bucket more).",
            MeasurementSkipped,
            stacklevel=3,
        )


def halves_of(aa: float, ab: float, bb: float, n_a: int, n_b: int, total: int, scale: float = 1.0) -> HalfStats:
    """The halves' statistics from the products of their shares ``a`` and ``b`` of the window's gradient (every
    sample weighed by ``1 / total``, the loss scaled by ``scale``): :math:`g_A = (N / n_A)\\,a / scale`,
    :math:`g_B = (N / n_B)\\,b / scale`.

    >>> halves_of(1.0, 0.5, 1.0, n_a=2, n_b=2, total=4)
    HalfStats(dot=2.0, sq_a=4.0, sq_b=4.0, n_a=2, n_b=2)
    """
    fa, fb = total / n_a / scale, total / n_b / scale
    return HalfStats(dot=ab * fa * fb, sq_a=aa * fa * fa, sq_b=bb * fb * fb, n_a=n_a, n_b=n_b)
