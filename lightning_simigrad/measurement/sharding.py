r"""Gradients split over ranks: how FSDP2's shards are read and weighed, and what each FSDP flavour must satisfy.

Under FSDP2 each rank's ``p.grad`` is a DTensor: its local piece is what the halves in time
(:mod:`~lightning_simigrad.measurement.time_halves`) read, and the products of the whole gradients are the sums of
the ranks' local products, weighed as below (:class:`ShardedPieces`).

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

Why halves in time under FSDP2 rather than rank groups inside its reduce-scatter (the DDP design): they cost one
all-gather of a row per rank and three fused norms over the local shards, touch no FSDP internals, and need only
that a window have two micro-batches per rank; rank groups would need FSDP2's reduce-scatter hook and its division
rules, and a second reduce-scatter or a two-stage one. ``docs/measurement.md`` compares them in bytes and time.

:func:`check_fsdp1_units` and :func:`refuse_unserved_fsdp1` say what FSDP1 must be for its measurements
(:mod:`~lightning_simigrad.measurement.reduce_scatter_groups` on an even number of ranks, the halves in time with a
midpoint reduction on an odd one): sharded over every rank, the gradient on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_simigrad.measurement._dots import HalfTensors, norm_weights, wide_dtype
from lightning_simigrad.measurement.protocol import Attachment

__all__ = [
    "FSDP1_SHARDINGS",
    "ShardedPieces",
    "check_fsdp1_units",
    "check_fsdp2",
    "check_sharding",
    "refuse_unserved_fsdp1",
]


class ShardedPieces:
    """FSDP2's gradient pieces: each DTensor's local shard, weighed by one over the ranks that hold it alike."""

    def __init__(self) -> None:
        # a gradient's weight by its layout, (placements, id(mesh)) -> (weight, mesh): the mesh is held so that its
        # id is not reused
        self._copies: dict[tuple[Any, int], tuple[float, Any]] = {}
        # the last weights vector made, by the weights of its tensors and its device: layouts rarely change
        self._vector: tuple[Any, Tensor] | None = None

    @staticmethod
    def storage(grad: Tensor) -> Tensor:
        """A DTensor gradient's local piece: the products read it and the re-joining adds into it, locally."""
        to_local = getattr(grad, "to_local", None)
        return to_local() if to_local is not None else grad

    def weights(self, halves: HalfTensors) -> Tensor | None:
        """One over the number of ranks holding each gradient tensor's piece alike (see the module docstring).

        Python attribute reads per tensor and, for a layout not met in the previous step, one small tensor
        made on the device; None (nothing to weigh) when no mesh dimension is replicated.
        """
        firsts, seconds, first_only, second_only = halves
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
            what = f"a gradient laid out as {_layout(grad)}"
            fix = (
                "Apply `fully_shard` to the module that holds its parameter: FSDP2 redistributes every gradient to its"
                " parameter's placements before reducing it."
            )
            known = self._copies[key] = (1.0 / _summable(placements, mesh, what, fix), mesh)
        return known[0]


def check_fsdp2(target: Attachment) -> None:
    """FSDP2 as :class:`ShardedPieces` reads it (:func:`check_sharding` on the module's parameters)."""
    check_sharding(list(target.params), target.data_parallel_size)


def _summable(placements: Any, mesh: Any, what: str, fix: str) -> int:
    """The ranks that hold a piece laid out on ``placements`` over ``mesh`` alike; refused (naming ``what`` and the
    ``fix``) where the pieces cannot be summed exactly over the ranks."""
    copies, refusal = _copies(placements, mesh)
    if refusal is not None:
        raise RuntimeError(f"SimiGrad under FSDP cannot sum {what} exactly over the ranks: {refusal} {fix}")
    return copies


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
        what = f"the gradient of parameter {index} (shape {tuple(p.shape)}, {_layout(p)})"
        fix = (
            "Give the parameter `Shard` or `Replicate` placements (`fully_shard` and `parallelize_module`'s styles do)."
        )
        _summable(placements, mesh, what, fix)


FSDP1_SHARDINGS = ("FULL_SHARD", "SHARD_GRAD_OP")  # every rank holds a disjoint shard of the reduced gradient


def refuse_unserved_fsdp1(sharding: str, cpu_offload: Any, where: str) -> None:
    """FSDP1 as its measurements serve it: sharded over every rank, the gradient on the device."""
    if sharding not in FSDP1_SHARDINGS:
        raise RuntimeError(
            f"SimiGrad under FSDP1 supports `sharding_strategy` {' or '.join(FSDP1_SHARDINGS)}; {where} uses"
            f" {sharding}, whose gradient is replicated across ranks. For hybrid sharding use"
            " `ModelParallelStrategy` with `fully_shard` on a (replicate, shard) mesh; for NO_SHARD use"
            " `strategy='ddp'`."
        )
    if getattr(cpu_offload, "offload_params", False):
        raise RuntimeError(
            f"SimiGrad under FSDP1 does not support CPU offload (untested: the measurement would read every gradient"
            f" shard on the CPU); {where} sets `cpu_offload={cpu_offload}`. Remove `cpu_offload`."
        )


def check_fsdp1_units(target: Attachment) -> None:
    """Every FSDP1 unit of the wrapped model served (units the module wrapped itself in ``configure_model`` too)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    world = dist.get_world_size()
    for unit in target.model.modules():
        if isinstance(unit, FullyShardedDataParallel):
            name = type(unit.module).__name__
            refuse_unserved_fsdp1(unit.sharding_strategy.name, unit.cpu_offload, f"the FSDP unit around `{name}`")
            ranks = dist.get_process_group_ranks(unit.process_group)
            if len(ranks) != world:
                raise RuntimeError(
                    f"SimiGrad under FSDP1 measures units sharded over all {world} ranks; the FSDP unit around"
                    f" `{name}` is sharded over ranks {ranks} (`process_group`). Shard every unit over all the ranks"
                    " (leave `process_group` out)."
                )
