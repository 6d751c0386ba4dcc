r"""Half-batch statistics under FSDP2: the window's two halves in time, on each rank's gradient pieces.

Under Lightning's ``ModelParallelStrategy`` with ``fully_shard``, FSDP2 reduces every micro-batch's
gradient (Lightning blocks no synchronisation during accumulation there), and each rank accumulates its
piece of the mean gradient in ``p.grad`` (a DTensor whose local tensor is the rank's piece of the
parameter). So the gradient after micro-batch :math:`j` already holds the contributions of every
data-parallel rank's samples, and the two halves in time of the window -- micro-batches
:math:`0..k/2-1` of all ranks against the rest -- can be measured exactly as on one process
(:class:`~lightning_simigrad.measurement.window_halves.WindowHalvesMeasurement`): set the accumulated
gradient aside at the midpoint (a move, no copy), let the second half accumulate on its own, and at the
last backward take :math:`s \cdot s`, :math:`s \cdot r`, :math:`r \cdot r` of the local pieces and add
:math:`s` back. The products of the whole gradients are then sums of the ranks' local products, gathered
over every rank of the world in :meth:`~ShardedHalvesMeasurement.collect`.

**What is served, and why the sums are exact.** A gradient with placements :math:`P` on a device mesh
:math:`M` (as FSDP2 leaves it in ``p.grad``: the parameter's own placements) is laid out per mesh
dimension :math:`d`: along a ``Shard`` dimension the ranks hold disjoint pieces (FSDP2 pads the last
piece with zeros, which add nothing; a strided shard, FSDP2's over a tensor-parallel shard of the same
tensor dimension, is disjoint too), along a ``Replicate`` dimension they hold the same values. Each
element of the gradient therefore lies on exactly :math:`c = \prod_{d:\,P_d = \mathrm{Replicate}}
|M_d|` ranks, the same value on each, and every rank weighs its local products of that tensor by
:math:`1/c`: summed over every rank of the mesh, each element counts once. The weights are read from
the gradients' placements (an attribute, no host read), kept per layout, and applied with one fused
multiply to the per-tensor squared norms (:func:`~lightning_simigrad.measurement._dots.gram_and_add_all_`);
with no replicated dimension there is nothing to weigh and no extra op. Powers of two (the usual
replica counts) weigh exactly; any other count rounds once, at :math:`10^{-16}`.

- FSDP2 on a one-dimensional mesh of all the ranks (``fully_shard`` on ``device_mesh["data_parallel"]``,
  ``tensor_parallel_size=1``): placements ``(Shard(0),)``, weight 1.
- HSDP (``fully_shard`` on a two-dimensional mesh ``("replicate", "shard")``): placements
  ``(Replicate(), Shard(0))``. FSDP2 reduce-scatters every micro-batch within the shard group and
  all-reduces the result within the replicate group, so every replica holds the same piece of the mean
  over all samples: weight :math:`1/|M_\mathrm{replicate}|`.
- Tensor parallelism with FSDP2 (``parallelize_module`` on ``device_mesh["tensor_parallel"]``, then
  ``fully_shard`` on ``device_mesh["data_parallel"]``): two-dimensional placements such as
  ``(_StridedShard(0), Shard(0))`` (``ColwiseParallel``), ``(Shard(0), Shard(1))`` (a ``RowwiseParallel``
  weight), weight 1, and ``(Shard(0), Replicate())`` (a ``RowwiseParallel`` bias, the same on the
  tensor-parallel ranks, which computed it from the same batch): weight :math:`1/|M_\mathrm{tp}|`.
  FSDP2 redistributes a tensor-parallel gradient to the parameter's placements before it reduces it, so
  ``p.grad`` carries no ``Partial`` placement. The samples are the data-parallel ranks' (the
  tensor-parallel ranks of one data-parallel rank feed the same batches); the products are summed over
  all the ranks.

Refused: a ``Partial`` gradient (each rank holds an addend of the values, and squares of addends do not
add up to the square of their sum: the step raises :class:`~lightning_simigrad.MeasurementError` on every
rank), and, before the first step, by :func:`check_sharding`: a trainable parameter that is no DTensor,
one on a mesh that does not span every rank (the ranks outside it hold copies nobody reduces with it), or
one with a placement other than ``Shard`` and ``Replicate``. What cannot be checked: that a replicated
dimension is reduced every micro-batch. FSDP2 does so unless ``set_requires_all_reduce(False)`` (or
``set_requires_gradient_sync(False)``) is set during accumulation, which SimiGrad does not support.

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
torch internals touched    none (``p.grad``, its            FSDP2's reduce-scatter hook, its
                           ``placements``, ``device_mesh``  pre-division and reduce-dtype rules
                           and ``to_local``)
constraint                 :math:`k \ge 2` micro-batches    one micro-batch per rank suffices
=========================  ===============================  ==========================================

The time halves cost a constant: three fused norms over the local pieces (:math:`3 P / W` reads), one
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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_simigrad.core.statistics import HalfStats
from lightning_simigrad.measurement import _ddp_scalars
from lightning_simigrad.measurement._dots import norm_weights, wide_dtype
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
    """FSDP2: the window's halves in time on each rank's gradient pieces, summed over the ranks in one all-gather.

    Implements :class:`~lightning_simigrad.measurement.protocol.Measurement`.

    Args:
        process_group: every rank that holds a piece of the parameters, the ranks of their device mesh (the
            default group when None: the whole world, tensor-parallel and replicate ranks included).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self._pg = process_group
        self._failure: BaseException | None = None
        # a gradient's weight by its layout, (placements, id(mesh)) -> (weight, mesh): the mesh is held so that
        # its id is not reused
        self._copies: dict[tuple[Any, int], tuple[float, Any]] = {}
        # the last weights vector made, by the weights of its tensors and its device: layouts rarely change
        self._vector: tuple[Any, Tensor] | None = None

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
        """A DTensor gradient's local piece: the products read it and the re-joining adds into it, locally."""
        to_local = getattr(grad, "to_local", None)
        return to_local() if to_local is not None else grad

    def weights(
        self,
        firsts: Sequence[Tensor],
        seconds: Sequence[Tensor],
        first_only: Sequence[Tensor],
        second_only: Sequence[Tensor],
    ) -> Tensor | None:
        """One over the number of ranks holding each gradient tensor's piece alike (see the module docstring).

        Python attribute reads per tensor and, for a layout not met in the previous step, one small tensor
        made on the device; None (nothing to weigh) when no mesh dimension is replicated.
        """
        pairs = [self._weight(g) for g in firsts]
        for first, second, weight in zip(firsts, seconds, pairs):
            if self._weight(second) != weight:  # two halves of one parameter's gradient: FSDP2 lays them out alike
                raise RuntimeError(
                    f"The two halves of a gradient are laid out differently ({_layout(first)} and"
                    f" {_layout(second)}); SimiGrad cannot weigh them alike."
                )
        key = (tuple(pairs), tuple(self._weight(g) for g in first_only), tuple(self._weight(g) for g in second_only))
        if all(w == 1.0 for part in key for w in part):
            return None
        device = next(iter((*firsts, *first_only, *second_only))).device
        if self._vector is None or self._vector[0] != (key, device):
            vector = torch.tensor(norm_weights(*key), dtype=wide_dtype(device), device=device)
            self._vector = ((key, device), vector)
        return self._vector[1]

    def _weight(self, grad: Tensor) -> float:
        placements, mesh = getattr(grad, "placements", None), getattr(grad, "device_mesh", None)
        if placements is None or mesh is None:
            return 1.0  # a plain tensor: refused by `check_sharding` before the first step
        key = (tuple(placements), id(mesh))
        known = self._copies.get(key)
        if known is None:
            copies, refusal = _copies(placements, mesh)
            if refusal is not None:
                raise RuntimeError(
                    f"SimiGrad under FSDP cannot sum a gradient laid out as {_layout(grad)} exactly over the ranks:"
                    f" {refusal} Apply `fully_shard` to the module that holds its parameter: FSDP2 redistributes"
                    " every gradient to its parameter's placements before reducing it."
                )
            known = self._copies[key] = (1.0 / copies, mesh)
        return known[0]


def _collective_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where the group's collectives take tensors: NCCL needs them on the GPU, gloo on the CPU."""
    backend = dist.get_backend(group)
    if backend == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo" and device.type == "cuda":
        return torch.device("cpu")
    return device


def _copies(placements: Sequence[Any], mesh: Any) -> tuple[int, str | None]:
    """How many ranks hold each element of a DTensor alike, or why its pieces cannot be summed exactly."""
    copies = 1
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            copies *= mesh.size(dim)
        elif placement.is_partial():
            return copies, (
                f"along mesh dimension {dim} it is `{placement!r}`: each rank holds an addend of its values, and"
                " the squares of addends do not add up to the square of their sum."
            )
        elif not (placement.is_shard() or isinstance(getattr(placement, "dim", None), int)):
            # a strided shard (FSDP2 over a tensor-parallel shard of the same tensor dimension) is no `Shard` but
            # has a tensor dimension: its pieces are disjoint
            return copies, f"along mesh dimension {dim} it is `{placement!r}`, neither sharded nor replicated."
    return copies, None


def _layout(tensor: Tensor) -> str:
    mesh = getattr(tensor, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None)
    shape = tuple(mesh.shape) if mesh is not None else ()
    where = f"a mesh of shape {shape}" + (f" {tuple(names)}" if names else "")
    return f"placements {tuple(getattr(tensor, 'placements', ()))} on {where}"


def check_sharding(params: Sequence[Tensor], data_parallel_size: int, group: dist.ProcessGroup | None = None) -> None:
    """Refuse parameters whose gradients the measurement cannot sum exactly over the ranks of ``group``.

    Served: every trainable parameter a DTensor on a device mesh of all the ranks (``group``, the whole world
    when None), each mesh dimension sharded or replicated: ``fully_shard`` on one dimension, HSDP, tensor
    parallelism with ``fully_shard`` over the data-parallel dimension.

    Raises:
        RuntimeError: a trainable parameter that is no DTensor (``fully_shard`` was not applied to the module
            that holds it, so nothing reduces its gradient), one on a mesh of only some of the ranks (its
            gradient is not reduced over the others: ``fully_shard`` on the data-parallel mesh is missing), or
            one with a placement other than ``Shard`` and ``Replicate``, or one offloaded to the CPU
            (``CPUOffloadPolicy``: untested).
    """
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else data_parallel_size
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
        if p.device.type == "cpu" and getattr(mesh, "device_type", "cpu") != "cpu":
            raise RuntimeError(
                f"SimiGrad under FSDP does not support CPU offload (untested: the measurement would read every"
                f" gradient shard on the CPU); parameter {index} (shape {tuple(p.shape)}) lives on the CPU while its"
                f" mesh is on `{mesh.device_type}`. Remove `offload_policy` from `fully_shard`."
            )
        if mesh.size() != world:
            raise RuntimeError(
                f"SimiGrad under FSDP sums every gradient's pieces over all {world} ranks ({data_parallel_size}"
                f" data-parallel); parameter {index} (shape {tuple(p.shape)}) has {_layout(p)}, which spans"
                f" {mesh.size()} of the {world} ranks: its gradient is not reduced over the others. Apply"
                " `fully_shard` over the data-parallel mesh (`self.device_mesh['data_parallel']`, or a 2-D"
                " ('replicate', 'shard') mesh of all the ranks for HSDP), after `parallelize_module` on"
                " `self.device_mesh['tensor_parallel']` under tensor parallelism, so that every parameter spans"
                " all the ranks."
            )
        _, refusal = _copies(placements, mesh)
        if refusal is not None:
            raise RuntimeError(
                f"SimiGrad under FSDP cannot sum the gradient of parameter {index} (shape {tuple(p.shape)},"
                f" {_layout(p)}) exactly over the ranks: {refusal} Give the parameter `Shard` or `Replicate`"
                " placements (`fully_shard` and `parallelize_module`'s styles do)."
            )
