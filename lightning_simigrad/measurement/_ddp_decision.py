r"""The decision of a DDP measurement: from the gathered rows to :class:`HalfStats`, or one error for all.

Pure arithmetic on Python floats. Every rank calls :func:`decide` with bitwise the same rows (an
all-gather copies bytes) and sums them in rank order, so every rank returns bitwise the same
statistics -- or raises the same :class:`MeasurementError`, with the same message, at the same step.

A row is ``[u.u, u.g, g.g, o.o, missing buckets, failure stage]`` (see
:mod:`lightning_simigrad.measurement._ddp_scalars`); :math:`u` is group A's share of the mean gradient :math:`g`
and :math:`o = g - u` group B's, with :math:`g_A = (N/n_A)\,u` and :math:`g_B = (N/n_B)\,o`.

>>> rows = [[4.0, 0.0, 9.0, 0.0, 0, 0], [0.0, 0.0, 0.0, 1.0, 0, 0]]  # W = 2: |u|^2 = 4, |o|^2 = 1, |g|^2 = 9
>>> decide(rows, n_a=2, n_b=2, squares=True)  # u.o = (9 - 4 - 1) / 2 = 2
HalfStats(dot=8.0, sq_a=16.0, sq_b=4.0, n_a=2, n_b=2)
>>> decide([[1.0, 0.0, 0.0, 0.0, 0, 0], [float("nan")] * 4 + [0, 2]], n_a=1, n_b=1, squares=True)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
lightning_simigrad.MeasurementError: SimiGrad's DDP measurement failed on rank 1 (in a gradient ...

A rank that ran out of memory for the measurement (stage ``-1``) is no failure: the step goes unmeasured.

>>> decide([[1.0, 0.0, 0.0, 0.0, 0, 0], [float("nan")] * 4 + [0, -1]], n_a=1, n_b=1, squares=True)
HalfStats(dot=nan, sq_a=nan, sq_b=nan, n_a=1, n_b=1)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_simigrad.core.statistics import HalfStats
from lightning_simigrad.measurement.protocol import MeasurementError

__all__ = ["SKIPPED", "STAGES", "decide", "skipped_ranks"]

SKIPPED = -1  # the stage a rank reports when it ran out of memory for the measurement (not a failure)

STAGES = {
    1: "while preparing a gradient bucket, before its collectives",
    2: "in a gradient bucket's arithmetic after its collectives",
    3: "in collect(), before its all-gather",
    4: "collect() was called after arm() but before a synchronising backward completed: arm before the "
    "window's last backward (the one outside `no_sync()`) and collect after it",
}


def decide(rows: Sequence[Sequence[float]], n_a: int, n_b: int, squares: bool) -> HalfStats:
    """The half-batch statistics from every rank's row, summed in rank order.

    Raises:
        MeasurementError: if any rank reported a failure or lost a bucket's result.
    """
    failed = [(rank, int(row[5])) for rank, row in enumerate(rows) if row[5] == row[5] and row[5] not in (0, SKIPPED)]
    if failed:
        ranks = ", ".join(str(rank) for rank, _ in failed)
        where = "; ".join(sorted({STAGES.get(stage, f"stage {stage}") for _, stage in failed}))
        raise MeasurementError(
            f"SimiGrad's DDP measurement failed on rank{'s' if len(failed) > 1 else ''} {ranks} ({where}). "
            "Every rank raises this error at the same step, before the optimizer steps; the original error is "
            f"chained to it on rank {failed[0][0]}."
        )
    if skipped_ranks(rows):  # the gradients are intact; only this step's statistics are lost
        return HalfStats(dot=math.nan, sq_a=math.nan, sq_b=math.nan, n_a=n_a, n_b=n_b)
    missing = sum(row[4] for row in rows)
    if missing:
        raise MeasurementError(
            f"SimiGrad's DDP measurement lost {int(missing)} gradient bucket result(s) of the synchronising "
            "backward; was the backward interrupted? Every rank raises this error at the same step."
        )
    uu = ug = gg = oo = 0.0
    for row in rows:  # the same additions in the same order on every rank: bitwise the same result
        uu, ug, gg, oo = uu + row[0], ug + row[1], gg + row[2], oo + row[3]
    if squares:  # W = 2: |g|^2 = u.u + 2 u.o + o.o, each square measured directly
        uo = 0.5 * (gg - uu - oo)
    else:  # from u.g: u.o = u.g - u.u, o.o = g.g - 2 u.g + u.u
        uo, oo = ug - uu, gg - 2.0 * ug + uu
    n = n_a + n_b
    c_a, c_b = n / n_a, n / n_b  # g_A = c_a u, g_B = c_b o
    return HalfStats(dot=c_a * c_b * uo, sq_a=c_a * c_a * uu, sq_b=c_b * c_b * oo, n_a=n_a, n_b=n_b)


def skipped_ranks(rows: Sequence[Sequence[float]]) -> list[int]:
    """The ranks that ran out of memory for this step's measurement."""
    return [rank for rank, row in enumerate(rows) if row[5] == SKIPPED]
