r"""Half-batch statistics under FSDP2: the window's two halves in time, on each rank's gradient shards.

Under Lightning's ``ModelParallelStrategy`` with ``fully_shard``, FSDP2 reduce-scatters every micro-batch's
gradient (Lightning blocks no synchronisation during accumulation there), and each rank accumulates its
shard of the mean gradient in ``p.grad`` (a DTensor whose local tensor is the rank's rows of the
parameter). So the sharded gradient after micro-batch :math:`j` already holds the contributions of every
rank's samples, and the two halves in time of the window -- micro-batches :math:`0..k/2-1` of all ranks
against the rest -- can be measured exactly as on one process
(:class:`~lightning_simigrad.measurement.window_halves.WindowHalvesMeasurement`): set the accumulated
sharded gradient aside at the midpoint (a move, no copy), let the second half accumulate on its own, and
at the last backward take :math:`s \cdot s`, :math:`s \cdot r`, :math:`r \cdot r` of the local shards and
add :math:`s` back. The shards of a parameter are disjoint rows (FSDP2 pads the last rank's shard with
zeros, which add nothing), so the products of the whole gradients are the sums of the ranks' local
products.

**The design, and why not rank groups.** The alternative is the DDP design: two groups of ranks, their
sums taken inside the reduce-scatter (FSDP2's ``set_custom_reduce_scatter``). Per optimizer step, with
:math:`P` parameters, :math:`W` ranks and a window of :math:`k` micro-batches:

=========================  ===============================  ==========================================
                           time halves (this module)        rank groups inside the reduce-scatter
=========================  ===============================  ==========================================
extra bytes sent           :math:`8 W` (one all-gather of   none if the reduce-scatter is split in two
                           4 float64 per rank)              stages; otherwise a second reduce-scatter
extra collectives          1 (tiny)                          0 to 1 per FSDP unit and micro-batch
extra memory per rank      one sharded gradient,            one unit's unsharded gradient per group
                           :math:`P / W` (moved, not
                           copied: the second half's
                           buffer is the only new one)
torch internals touched    none (``p.grad`` and             FSDP2's reduce-scatter hook, its
                           ``DTensor.to_local``)             pre-division and reduce-dtype rules
constraint                 :math:`k \ge 2` micro-batches    one micro-batch per rank suffices
=========================  ===============================  ==========================================

The time halves cost a constant: three fused norms over the local shards (:math:`3 P / W` reads), one
all-gather of :math:`4 W` numbers and the host read SimiGrad does every step anyway. Their one cost is
the constraint: the window has at least two micro-batches per rank (the run plans them so), where DDP's
rank groups need one. Products are taken in the reduce dtype FSDP2 leaves in ``p.grad`` (the parameter's
dtype: float32 under ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), accumulated in
float32 and summed in float64 (:mod:`~lightning_simigrad.measurement._dots`): about :math:`10^{-6}` in the
similarity, as on one process. ``benchmarks/fsdp_overhead.py`` measures step time and bytes.

**Failures.** Every rank calls the all-gather in :meth:`~ShardedHalvesMeasurement.collect`, whatever
happened locally; a rank whose products failed sends NaN with the stage it failed at, and every rank
raises the same :class:`~lightning_simigrad.MeasurementError` at the same step (the original error chained
to it on the rank where it happened), before the optimizer steps -- as under DDP.

Served: every trainable parameter a DTensor sharded over all the data-parallel ranks (``fully_shard``
on a one-dimensional mesh, Lightning's ``ModelParallelStrategy(tensor_parallel_size=1)``).
:func:`check_sharding` refuses anything else before the first step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_simigrad.core.statistics import HalfStats
from lightning_simigrad.measurement import _ddp_scalars
from lightning_simigrad.measurement.protocol import LossScale, MeasurementError, loss_scale_of
from lightning_simigrad.measurement.window_halves import WindowHalvesMeasurement, halves_of

__all__ = ["ShardedHalvesMeasurement", "check_sharding"]

_ROW = 4  # [s.s, s.r, r.r, stage] of one rank
_OK, _UNMEASURED, _COMBINE, _COLLECT = 0.0, -2.0, 1.0, 3.0
_STAGES = {
    _COMBINE: "while comparing the window's halves after its last backward",
    _COLLECT: "in collect(), before its all-gather",
}


class ShardedHalvesMeasurement(WindowHalvesMeasurement):
    """FSDP2: the window's halves in time on each rank's gradient shards, summed over the ranks in one all-gather.

    Implements :class:`~lightning_simigrad.measurement.protocol.Measurement`.

    Args:
        process_group: the group the parameters are sharded over (the default group when None).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self._pg = process_group
        self._failure: BaseException | None = None

    def after_backward(self, window, index, fed, params) -> None:  # type: ignore[no-untyped-def]
        try:
            super().after_backward(window, index, fed, params)
        except Exception as error:  # reported to every rank by collect(), whose all-gather every rank reaches
            self._failure = error
            self._first = []
            self._products = None

    def abort(self) -> None:
        super().abort()
        self._failure = None  # every rank abandons the window alike: nothing of it is reported

    def collect(self, loss_scale: LossScale) -> HalfStats | None:
        self.restore()
        measured, self._products = self._products, None
        failure, self._failure = self._failure, None
        stage = _COMBINE if failure is not None else (_UNMEASURED if measured is None else _OK)
        try:
            row = self._row(measured[0] if measured is not None else None, stage)
        except Exception as error:
            failure, row = error, torch.full((_ROW,), float("nan"), dtype=torch.float64)
            row[3] = _COLLECT
        rows, scale = self._gather(row, loss_scale_of(loss_scale))
        self._read = []  # the host read waited for every op that read the set-aside shards
        failed = [(rank, r[3]) for rank, r in enumerate(rows) if r[3] > 0]
        if failed:
            ranks = ", ".join(str(rank) for rank, _ in failed)
            where = "; ".join(sorted({_STAGES[stage] for _, stage in failed}))
            raise MeasurementError(
                f"SimiGrad's FSDP measurement failed on rank{'s' if len(failed) > 1 else ''} {ranks} ({where}). "
                "Every rank raises this error at the same step, before the optimizer steps; the original error is "
                f"chained to it on rank {failed[0][0]}."
            ) from failure
        if measured is None or any(r[3] == _UNMEASURED for r in rows):
            return None
        ss = sr = rr = 0.0
        for r in rows:  # the same additions in the same order on every rank: bitwise the same statistics
            ss, sr, rr = ss + r[0], sr + r[1], rr + r[2]
        _, n_a, n_b, total = measured
        return halves_of(ss, sr, rr, n_a, n_b, total, scale)

    def _row(self, products: Tensor | None, stage: float) -> Tensor:
        row = torch.zeros(_ROW, dtype=torch.float64, device=products.device if products is not None else None)
        if products is not None:
            row[:3] = products
        row[3] = stage
        return row

    def _gather(self, row: Tensor, loss_scale: LossScale) -> tuple[list[list[float]], float]:
        """Every rank's row, in rank order, and the loss scale, read to the host in one transfer."""
        row = row.to(_collective_device(self._pg, row.device))
        try:
            rows = _ddp_scalars.gather(row, self._pg, dist.get_world_size(self._pg))
        except Exception as error:
            raise RuntimeError(
                f"The all-gather of SimiGrad's FSDP measurement failed ({type(error).__name__}: {error}). A rank "
                "died or the process group timed out; see the first failing rank's log."
            ) from error
        return _ddp_scalars.fetch(rows, loss_scale)  # the measurement's one host synchronisation per step

    @staticmethod
    def storage(grad: Tensor) -> Tensor:
        """A DTensor gradient's local shard: the products read it and the re-joining adds into it, locally."""
        to_local = getattr(grad, "to_local", None)
        return to_local() if to_local is not None else grad


def _collective_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where the group's collectives take tensors: NCCL needs them on the GPU, gloo on the CPU."""
    backend = dist.get_backend(group)
    if backend == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo" and device.type == "cuda":
        return torch.device("cpu")
    return device


def check_sharding(params: Sequence[Tensor], data_parallel_size: int) -> None:
    """Refuse parameters the measurement cannot sum exactly: every trainable one sharded over all the ranks.

    Raises:
        RuntimeError: a trainable parameter that is no DTensor (``fully_shard`` was not applied to the module
            that holds it, so nothing reduces its gradient), or one replicated along a mesh dimension
            (HSDP, tensor parallelism).
    """
    for index, p in enumerate(params):
        if not p.requires_grad:
            continue
        placements = getattr(p, "placements", None)
        mesh = getattr(p, "device_mesh", None)
        if placements is None or mesh is None:
            raise RuntimeError(
                f"SimiGrad under FSDP needs every trainable parameter sharded by `fully_shard`; parameter {index}"
                f" (shape {tuple(p.shape)}) is a plain `{type(p).__name__}`, whose gradient no rank reduces."
                " Apply `fully_shard` to the root module too in `configure_model`."
            )
        if len(placements) != 1 or not placements[0].is_shard() or mesh.size() != data_parallel_size:
            raise RuntimeError(
                f"SimiGrad under FSDP supports parameters sharded over all {data_parallel_size} data-parallel"
                f" ranks (`fully_shard` on a one-dimensional mesh); parameter {index} (shape {tuple(p.shape)}) has"
                f" placements {tuple(placements)} on a mesh of {mesh.size()} ranks. HSDP and tensor parallelism"
                " are not supported yet: use `ModelParallelStrategy(tensor_parallel_size=1)` and `fully_shard`"
                " without a replicate dimension."
            )
