"""How numbers cross ranks: one module for every exchange SimiGrad makes.

- :class:`Rows`: every per-step number that crosses ranks rides in one row of float64 numbers per rank, gathered
  over the process group (one collective) and read to the host in one transfer with the GradScaler's scale (one
  synchronisation). A step costs that, whatever the strategy and whatever the step's rows carry: the measurement's
  products and failure stage, and the loss items of a step weighed by them
  (:mod:`~lightning_simigrad.measurement.rows` lays the row out). On one process nothing crosses: the row is read as
  it is.
- :func:`gather_objects`: a few small Python values from every rank, pickled (a stream's counts when it plans a
  window; the checkpoint's per-rank pieces when one is written). Never per micro-batch.

Which device a collective takes its tensors on is decided here only (:func:`collective_device`): NCCL's on the GPU,
gloo's on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_simigrad import _compat

__all__ = ["Rows", "collective_device", "distributed", "gather_objects", "processes", "read_rows"]

LossScale = Any  # a GradScaler's scale: a one-element tensor (read with the rows), a number, or None (1)


def distributed() -> bool:
    """Whether a process group of more than one process is up."""
    return processes() > 1


def processes() -> int:
    """The processes of the default group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Rows:
    """Every rank's row, in rank order, on every rank: an all-gather over ``group`` (None: none, one process).

    Args:
        group: the process group (the default group when ``collective`` and None).
        collective: rows cross ranks; False on one process, where the row is read as it is.
        what: what the rows measure, for the message when the all-gather itself fails.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, collective: bool = True, what: str = "DDP") -> None:
        self.group, self.collective, self.what = group, collective, what

    def gather(self, local: Tensor, loss_scale: LossScale) -> tuple[list[list[float]], float]:
        """Every rank's row and the loss scale, as Python floats read from the device in one transfer."""
        if not self.collective:
            return read_rows(local.view(1, -1), loss_scale)
        local = local.to(collective_device(self.group, local.device))
        world = dist.get_world_size(self.group)
        try:
            gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
            _compat.all_gather_into(gathered, local, group=self.group)
        except Exception as error:
            raise RuntimeError(
                f"The all-gather of SimiGrad's {self.what} measurement failed ({type(error).__name__}: {error}). A"
                " rank died or the process group timed out; see the first failing rank's log."
            ) from error
        return read_rows(gathered.view(world, local.numel()), loss_scale)


def read_rows(rows: Tensor, loss_scale: LossScale) -> tuple[list[list[float]], float]:
    """``rows`` (one per rank) and the loss scale read to the host in a single transfer."""
    flat = rows.reshape(-1)
    if isinstance(loss_scale, Tensor):
        flat = torch.cat([flat, loss_scale.detach().reshape(1).to(flat)])
    values = flat.tolist()  # the step's one host synchronisation
    scale = values.pop() if isinstance(loss_scale, Tensor) else float(loss_scale or 1.0)
    width = rows.shape[-1]
    return [values[i : i + width] for i in range(0, len(values), width)], scale


def gather_objects(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value``, in rank order (a collective: call it on every rank of ``group``); ``[value]`` on one
    process. Values are pickled: plain Python values and bytes (in torch 2.14 it cannot carry tensors)."""
    if not distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def collective_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where the group's collectives take tensors: NCCL needs them on the GPU, gloo on the CPU."""
    backend = dist.get_backend(group)
    if backend == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo" and device.type == "cuda":
        return torch.device("cpu")
    return device
