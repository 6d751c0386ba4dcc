r"""How a measurement's products cross ranks: one row per rank, one all-gather, one host read, one verdict.

Every measurement ends a window with a few products of the two halves' shares of the gradient, taken on the
rank's own part of it (the whole gradient on one process, a slice of a bucket under DDP, a shard under FSDP).
Each rank writes them into a row of :data:`WIDTH` float64 numbers,

    ``[p0, p1, p2, p3, missing, stage]``

(four products, the gradient buckets whose products went missing, and the :class:`Stage` where the measurement
failed on this rank, 0 if it did not), built on the device without reading anything back. An :class:`Exchange`
brings every rank's row to every rank: all-gathered over the process group (the only collective of the window's
``collect``, issued on every rank whatever happened before), then read to the host in a single transfer with the
GradScaler's scale -- the measurement's one host synchronisation per optimizer step. On one process the row is
read as it is.

:func:`verdict` then reads the rows alike on every rank (an all-gather copies bytes, so every rank holds bitwise
the same rows): a failure on any rank raises the same :class:`~lightning_simigrad.MeasurementError`, with the same
message, on every rank at the same step, before the optimizer steps (the rank where it happened chains the
original error); a rank out of memory for the measurement skips the step's statistics on every rank; otherwise
the products are summed in rank order, so every rank takes bitwise the same decision.

>>> rows = [[4.0, 0.0, 9.0, 0.0, 0, 0], [0.0, 0.0, 0.0, 1.0, 0, 0]]
>>> verdict(rows, "DDP").sums
(4.0, 0.0, 9.0, 1.0)
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
import torch.distributed as dist
from torch import Tensor

from lightning_simigrad import _compat
from lightning_simigrad.measurement.protocol import LossScale, MeasurementError

__all__ = ["WIDTH", "Exchange", "Stage", "Verdict", "failed_row", "row", "verdict"]

WIDTH = 6  # [p0, p1, p2, p3, missing buckets, failure stage]


class Stage(enum.IntEnum):
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
    Stage.PREPARE: "while preparing a gradient bucket, before its collectives",
    Stage.FINISH: "in a gradient bucket's arithmetic after its collectives",
    Stage.COLLECT: "in collect(), before its all-gather",
    Stage.NO_BACKWARD: "collect() was called after arm() but before a synchronising backward completed: arm before"
    " the window's last backward (the one outside `no_sync()`) and collect after it",
    Stage.COMBINE: "while comparing the window's halves after its last backward",
}


def row(products: Tensor | None, stage: Stage = Stage.OK, missing: int = 0, device: Any = None) -> Tensor:
    """This rank's row on the products' device (or ``device``), without reading anything to the host.

    ``products`` holds up to four numbers; a failure ``stage`` makes them NaN, so that no rank can mistake them for
    a measurement.
    """
    if stage > 0 or products is None:
        out = torch.full((WIDTH,), float("nan") if stage > 0 else 0.0, dtype=torch.float64, device=device)
    else:
        out = torch.zeros(WIDTH, dtype=torch.float64, device=products.device)
        out[: products.numel()] = products
    out[4] = float(missing)  # fills with host numbers: no transfer, no synchronisation
    out[5] = float(stage)
    return out


def failed_row(device: Any, stage: Stage) -> Tensor:
    """A row that carries NaN products and the failure ``stage`` to every rank."""
    return row(None, stage, device=device)


class Exchange:
    """Every rank's row, in rank order, on every rank: an all-gather over ``group`` (None: none, one process).

    Args:
        group: the process group (the default group when ``collective`` and None).
        collective: rows cross ranks; False on one process, where the row is read as it is.
        what: the measurement's name, for the message when the all-gather itself fails.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, collective: bool = True, what: str = "DDP") -> None:
        self.group, self.collective, self.what = group, collective, what

    def rows(self, local: Tensor, loss_scale: LossScale) -> tuple[list[list[float]], float]:
        """Every rank's row and the loss scale, as Python floats read from the device in one transfer."""
        if not self.collective:
            return _fetch(local.view(1, -1), loss_scale)
        local = local.to(_collective_device(self.group, local.device))
        world = dist.get_world_size(self.group)
        try:
            gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
            _compat.all_gather_into(gathered, local, group=self.group)
        except Exception as error:
            raise RuntimeError(
                f"The all-gather of SimiGrad's {self.what} measurement failed ({type(error).__name__}: {error}). A"
                " rank died or the process group timed out; see the first failing rank's log."
            ) from error
        return _fetch(gathered.view(world, local.numel()), loss_scale)


def _fetch(rows: Tensor, loss_scale: LossScale) -> tuple[list[list[float]], float]:
    flat = rows.reshape(-1)
    if isinstance(loss_scale, Tensor):
        flat = torch.cat([flat, loss_scale.detach().reshape(1).to(flat)])
    values = flat.tolist()  # the measurement's one host synchronisation per step
    scale = values.pop() if isinstance(loss_scale, Tensor) else float(loss_scale or 1.0)
    width = rows.shape[-1]
    return [values[i : i + width] for i in range(0, len(values), width)], scale


def _collective_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where the group's collectives take tensors: NCCL needs them on the GPU, gloo on the CPU."""
    backend = dist.get_backend(group)
    if backend == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo" and device.type == "cuda":
        return torch.device("cpu")
    return device


@dataclass(frozen=True)
class Verdict:
    """What every rank's rows say: the products summed in rank order, or why there are none."""

    sums: tuple[float, float, float, float] | None = None  # None: not measured (skipped or unmeasured)
    skipped: list[int] = field(default_factory=list)  # ranks out of memory for the measurement


def verdict(rows: Sequence[Sequence[float]], what: str) -> Verdict:
    """The rows read alike on every rank.

    Raises:
        MeasurementError: if any rank reported a failure or lost a bucket's result (the same on every rank).
    """
    failed = [(rank, Stage(int(r[5]))) for rank, r in enumerate(rows) if r[5] == r[5] and r[5] > 0]
    if failed:
        ranks = ", ".join(str(rank) for rank, _ in failed)
        where = "; ".join(sorted({_FAILURES[stage] for _, stage in failed}))
        raise MeasurementError(
            f"SimiGrad's {what} measurement failed on rank{'s' if len(failed) > 1 else ''} {ranks} ({where}). "
            "Every rank raises this error at the same step, before the optimizer steps; the original error is "
            f"chained to it on rank {failed[0][0]}."
        )
    skipped = [rank for rank, r in enumerate(rows) if r[5] == Stage.SKIPPED]
    if skipped:  # the gradients are intact; only this step's statistics are lost
        return Verdict(skipped=skipped)
    if any(r[5] == Stage.UNMEASURED for r in rows):
        return Verdict()
    missing = sum(r[4] for r in rows)
    if missing:
        raise MeasurementError(
            f"SimiGrad's {what} measurement lost {int(missing)} gradient bucket result(s) of the synchronising "
            "backward; was the backward interrupted? Every rank raises this error at the same step."
        )
    p0 = p1 = p2 = p3 = 0.0
    for r in rows:  # the same additions in the same order on every rank: bitwise the same result
        p0, p1, p2, p3 = p0 + r[0], p1 + r[1], p2 + r[2], p3 + r[3]
    return Verdict(sums=(p0, p1, p2, p3))
