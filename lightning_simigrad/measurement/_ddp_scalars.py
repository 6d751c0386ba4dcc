"""The scalar reduction of a DDP measurement: one row per rank, one all-gather, one host transfer.

Each rank's row is ``[u.u, u.g, g.g, o.o, missing buckets, failure stage]`` (float64). Every rank
builds its row on the device without reading anything back, the rows are all-gathered over DDP's
process group (the only collective of ``collect()``, issued on every rank whatever happened before),
and the gathered rows -- with the GradScaler's scale appended, when there is one -- come to the host in
a single transfer: the one host synchronisation the measurement costs per optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_simigrad import _compat
from lightning_simigrad.measurement import _ddp_decision
from lightning_simigrad.measurement._ddp_hook import Round

__all__ = ["COLLECT", "NO_BACKWARD", "ROW", "SKIPPED", "failed_row", "fetch", "gather", "local_row"]

ROW = 6
COLLECT = 3  # failure stage: building this rank's row in collect(), before the all-gather
NO_BACKWARD = 4  # collect() after arm() with no synchronising backward in between
SKIPPED = _ddp_decision.SKIPPED  # not a failure: out of memory for the measurement; the step goes unmeasured


def local_row(round: Round, computing: bool, device: torch.device, stream: Any) -> Tensor:
    """This rank's row, on ``device``, in the current stream; NaN products if the round failed here.

    ``stream`` is the measurement stream the bucket products were made on (None on CPU): the current
    stream waits for it, and the products are marked as read here before they are freed.
    """
    if not round.started or round.num_buckets == 0:  # no backward, or one that never reached its last bucket
        return failed_row(device, NO_BACKWARD)
    if round.failure is not None:
        return failed_row(device, round.failure[0])
    if round.skipped is not None:
        return failed_row(device, SKIPPED)
    with round.lock:
        present = [round.partials[i] for i in range(round.num_buckets) if i in round.partials]
    missing = round.num_buckets - len(present) if computing else 0
    if stream is not None:
        current = torch.cuda.current_stream(device)
        current.wait_stream(stream)
        for partial in present:
            partial.record_stream(current)
    row = torch.zeros(ROW, dtype=torch.float64, device=device)
    if present:
        row[:4] = torch.stack(present).sum(dim=0)
    row[4] = float(missing)  # a fill with a host number: no transfer, no synchronisation
    return row


def failed_row(device: torch.device, stage: int) -> Tensor:
    """A row that carries NaN products and the failure ``stage`` to every rank."""
    row = torch.full((ROW,), float("nan"), dtype=torch.float64, device=device)
    row[4] = 0.0
    row[5] = float(stage)
    return row


def gather(row: Tensor, group: dist.ProcessGroup | None, world_size: int) -> Tensor:
    """Every rank's row, in rank order: a ``(world_size, len(row))`` tensor, identical on every rank.

    Also the FSDP measurement's reduction (:mod:`~lightning_simigrad.measurement.sharded_halves`, rows of 4).
    """
    out = torch.empty(world_size * row.numel(), dtype=row.dtype, device=row.device)
    _compat.all_gather_into(out, row, group=group)
    return out.view(world_size, row.numel())


def fetch(rows: Tensor, loss_scale: Tensor | float | None) -> tuple[list[list[float]], float]:
    """The rows and the loss scale as Python floats, read from the device in one transfer."""
    flat = rows.reshape(-1)
    if isinstance(loss_scale, Tensor):
        flat = torch.cat([flat, loss_scale.detach().reshape(1).to(flat)])
    values = flat.tolist()  # the measurement's one host synchronisation per step
    scale = values.pop() if isinstance(loss_scale, Tensor) else float(loss_scale or 1.0)
    width = rows.shape[-1]
    return [values[i : i + width] for i in range(0, len(values), width)], scale
