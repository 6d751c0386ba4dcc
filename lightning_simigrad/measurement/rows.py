r"""A step's row: what every rank reports at a window's end, laid out for one exchange, and the verdict read from it.

Every measurement ends a window with a few products of the two halves' shares of the gradient, taken on the
rank's own part of it (the whole gradient on one process, a slice of a bucket under DDP, a shard under FSDP).
Each rank writes them into a row of float64 numbers,

    ``[p0, p1, p2, p3, missing, stage, *columns]``

(four products, the gradient buckets whose products went missing, the :class:`Outcome` where the measurement
failed on this rank, 0 if it did not, and the numbers the run declares beside them: the loss items of each half
where a step is weighed by them, :class:`~lightning_simigrad.measurement.protocol.Columns`), built on the device
without reading anything back. :class:`~lightning_simigrad.exchange.Rows` brings every rank's row to every rank:
one all-gather, one host read with the GradScaler's scale, the step's only collective and synchronisation; on one
process the row is read as it is.

:func:`verdict` then reads the rows alike on every rank (an all-gather copies bytes, so every rank holds bitwise
the same rows): a failure on any rank raises the same :class:`~lightning_simigrad.MeasurementError`, with the same
message, on every rank at the same step, before the optimizer steps (the rank where it happened chains the
original error); a rank out of memory for the measurement skips the step's statistics on every rank; otherwise
the products are summed in rank order, so every rank takes bitwise the same decision. The columns are summed
alike, whatever the measurement found.

>>> rows = [[4.0, 0.0, 9.0, 0.0, 0, 0], [0.0, 0.0, 0.0, 1.0, 0, 0]]
>>> verdict(rows, "DDP").sums
(4.0, 0.0, 9.0, 1.0)
>>> verdict([[1.0, 0.0, 0.0, 0.0, 0, 0, 5], [0.0, 0.0, 0.0, 0.0, 0, -2, 7]], "DDP").columns
(12.0,)
>>> verdict([[1.0, 0.0, 0.0, 0.0, 0, 0], [float("nan")] * 4 + [0, 2]], "DDP")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
lightning_simigrad.MeasurementError: SimiGrad's DDP measurement failed on rank 1 (in a gradient ...
>>> verdict([[1.0, 0.0, 0.0, 0.0, 0, 0], [float("nan")] * 4 + [0, -1]], "DDP").skipped
[1]
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_simigrad.measurement.protocol import Columns, MeasurementError

__all__ = ["WIDTH", "Columns", "Outcome", "Verdict", "failed_row", "row", "verdict"]

WIDTH = 6  # [p0, p1, p2, p3, missing buckets, failure stage], then the run's columns


class Outcome(enum.IntEnum):
    """Where a measurement stood on a rank at the window's end; positive values are failures."""

    OK = 0
    SKIPPED = -1  # out of memory for the measurement: the gradients are intact, the step goes unmeasured
    UNMEASURED = -2  # this rank has nothing to compare (a half without samples, a skipped last micro-batch)
    PREPARE = 1
    FINISH = 2
    COLLECT = 3
    NO_BACKWARD = 4
    COMBINE = 5


_FAILURES = {
    Outcome.PREPARE: "while preparing a gradient bucket, before its collectives",
    Outcome.FINISH: "in a gradient bucket's arithmetic after its collectives",
    Outcome.COLLECT: "in collect(), before its all-gather",
    Outcome.NO_BACKWARD: "collect() was called after arm() but before a synchronising backward completed: arm before"
    " the window's last backward (the one outside `no_sync()`) and collect after it",
    Outcome.COMBINE: "while comparing the window's halves after its last backward",
}


def row(
    products: Tensor | None,
    stage: Outcome = Outcome.OK,
    missing: int = 0,
    device: Any = None,
    columns: Sequence[float] = (),
) -> Tensor:
    """This rank's row on the products' device (or ``device``), without reading anything to the host.

    ``products`` holds up to four numbers; a failure ``stage`` makes them NaN, so that no rank can mistake them for
    a measurement. ``columns`` follow them.
    """
    width = WIDTH + len(columns)
    if stage > 0 or products is None:
        out = torch.full((width,), float("nan") if stage > 0 else 0.0, dtype=torch.float64, device=device)
    else:
        out = torch.zeros(width, dtype=torch.float64, device=products.device)
        out[: products.numel()] = products
    out[4] = float(missing)  # fills with host numbers: no transfer, no synchronisation
    out[5] = float(stage)
    for i, value in enumerate(columns):
        out[WIDTH + i] = float(value)
    return out


def failed_row(device: Any, stage: Outcome, columns: Sequence[float] = ()) -> Tensor:
    """A row that carries NaN products and the failure ``stage`` to every rank."""
    return row(None, stage, device=device, columns=columns)


@dataclass(frozen=True)
class Verdict:
    """What every rank's rows say: the products summed in rank order, or why there are none."""

    sums: tuple[float, float, float, float] | None = None  # None: not measured (skipped or unmeasured)
    skipped: list[int] = field(default_factory=list)  # ranks out of memory for the measurement
    columns: tuple[float, ...] = ()  # the run's columns, summed over the ranks


def verdict(rows: Sequence[Sequence[float]], what: str) -> Verdict:
    """The rows read alike on every rank.

    Raises:
        MeasurementError: if any rank reported a failure or lost a bucket's result (the same on every rank).
    """
    failed = [(rank, Outcome(int(r[5]))) for rank, r in enumerate(rows) if r[5] == r[5] and r[5] > 0]
    if failed:
        ranks = ", ".join(str(rank) for rank, _ in failed)
        where = "; ".join(sorted({_FAILURES[stage] for _, stage in failed}))
        raise MeasurementError(
            f"SimiGrad's {what} measurement failed on rank{'s' if len(failed) > 1 else ''} {ranks} ({where}). "
            "Every rank raises this error at the same step, before the optimizer steps; the original error is "
            f"chained to it on rank {failed[0][0]}."
        )
    columns = tuple(float(sum(c)) for c in zip(*(r[WIDTH:] for r in rows)))  # in rank order, as the products
    skipped = [rank for rank, r in enumerate(rows) if r[5] == Outcome.SKIPPED]
    if skipped:  # the gradients are intact; only this step's statistics are lost
        return Verdict(skipped=skipped, columns=columns)
    if any(r[5] == Outcome.UNMEASURED for r in rows):
        return Verdict(columns=columns)
    missing = sum(r[4] for r in rows)
    if missing:
        raise MeasurementError(
            f"SimiGrad's {what} measurement lost {int(missing)} gradient bucket result(s) of the synchronising "
            "backward; was the backward interrupted? Every rank raises this error at the same step."
        )
    p0 = p1 = p2 = p3 = 0.0
    for r in rows:  # the same additions in the same order on every rank: bitwise the same result
        p0, p1, p2, p3 = p0 + r[0], p1 + r[1], p2 + r[2], p3 + r[3]
    return Verdict(sums=(p0, p1, p2, p3), columns=columns)
