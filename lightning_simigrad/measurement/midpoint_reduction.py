r"""Half-batch statistics under FSDP1 (``FSDPStrategy``): the window reduced at its midpoint too.

Under Lightning's ``FSDPStrategy`` the micro-batches of an accumulation window run inside FSDP1's
``no_sync``: each rank keeps its own unreduced, *unsharded* gradient until the window's last backward,
which reduce-scatters it. At the midpoint a rank therefore holds only its own samples' first half, and
the halves in time of all ranks (the FSDP2 design,
:mod:`~lightning_simigrad.measurement.sharded_halves`) cannot be read there without reducing them.

So this measurement asks for one more reduction: the last micro-batch of the window's first half runs
with synchronisation (:attr:`MidpointReductionMeasurement.midpoint_reduction`; the callback lets that
backward out of ``no_sync``). FSDP1 reduce-scatters the first half's accumulated gradient there, and each
rank's parameters then hold their shard of :math:`s` (every rank's first-half samples, each weighed by
:math:`1/N`). The second half accumulates in ``no_sync`` again, and the last backward reduce-scatters it
and adds it to the shard FSDP1 kept (its documented way of mixing accumulation with and without
communication), leaving :math:`g = s + r` -- plain FSDP1's gradient, up to the order of two float
additions. The measurement

1. copies the shards of :math:`s` when the second half starts (one fused op; FSDP1 owns the buffer the
   shards live in and keeps them there, so they are copied, not moved);
2. after the last backward forms :math:`r = g - s` on the shards (one fused op, exact up to rounding
   :math:`g`) and takes :math:`|s|^2`, :math:`|r|^2` and :math:`|s + r|^2`, whence :math:`s \cdot r`
   (:func:`~lightning_simigrad.measurement._dots.gram_and_add_all_`, as on one process);
3. in ``collect`` all-gathers four float64 numbers per rank and sums them (the FSDP2 measurement's
   reduction and failure protocol, inherited).

The gradient the optimizer steps with is never written to. Shards are disjoint and FSDP1 pads with
zeros, so the sums of the ranks' local products are the products of the whole gradients.

**Cost, against plain FSDP1 with accumulation** (per optimizer step, :math:`P` parameters, :math:`W`
ranks): one more reduce-scatter of the gradient (:math:`(W-1)P/W` elements sent per rank, as many as the
window's own), one tiny all-gather (:math:`8W` bytes), the copy of :math:`s` and the transient
:math:`r`: :math:`2P/W` elements of memory per rank beside the :math:`P` of the unsharded gradient
``no_sync`` keeps. ``benchmarks/fsdp_overhead.py`` measures it.

**Where it serves: an odd number of ranks.** On an even number,
:class:`~lightning_simigrad.measurement.two_stage_reduce_scatter.TwoStageReduceScatterMeasurement` measures two
groups of ranks inside a two-stage reduce-scatter that moves the bytes of FSDP1's own, at no extra gradient
traffic; it needs partner ranks, which an odd number does not have. The two, measured by
``benchmarks/fsdp_overhead.py --fsdp 1`` (a 0.92M-parameter encoder, 5 units, windows of 2 micro-batches per
rank, bytes per step and rank):

======  ==============================  =====================================================
W       this module (midpoint)           two stages (``TwoStageReduceScatterMeasurement``)
======  ==============================  =====================================================
2       8,720.4 -> 10,569.8 kB (+21%)    8,720.4 -> 8,720.4 kB (+32 B); 5 all-to-alls for 5
                                          reduce-scatters
4       13,080.6 -> 15,854.7 kB (+21%)   13,080.6 -> 13,080.7 kB (+96 B); 5 group reduce-scatters
                                          and 5 all-to-alls for 5 reduce-scatters
======  ==============================  =====================================================

Both read the halves alike in precision: ``benchmarks/fsdp_accuracy.py`` (a float32 MLP, every step against
float64 products of the same samples at the same weights) measured the products' largest relative error at
2.3e-7 (two stages) and 1.8e-7 (midpoint) in float32, 2.5e-3 and 1.9e-3 with bf16 parameters and a float32
reduction, 2.3e-3 and 2.1e-3 with both in bf16 -- bf16's own forward and backward, about the same for FSDP2's
halves in time (2.9e-3).

The midpoint reduction sends twice plain FSDP1's gradient bytes with any window of :math:`k \ge 2`
micro-batches (FSDP2 under Lightning, which reduces every micro-batch, sends :math:`k` times), holds a copy of
the first half's shards, and touches no FSDP internals.

Served: ``FULL_SHARD`` and ``SHARD_GRAD_OP`` without CPU offload, with ``use_orig_params`` either way
(the parameters the optimizer steps are what is measured). The integration refuses the rest
(:func:`~lightning_simigrad.integration.neighbours.refuse_unsupported`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_simigrad import _compat
from lightning_simigrad.measurement._dots import gram_and_add_all_
from lightning_simigrad.measurement.sharded_halves import ShardedHalvesMeasurement

__all__ = ["MidpointReductionMeasurement"]


class MidpointReductionMeasurement(ShardedHalvesMeasurement):
    """FSDP1: the gradient reduce-scattered at the window's midpoint too; the first half's shards copied there,
    the second half's taken as the window's less the first's at the end.

    Implements :class:`~lightning_simigrad.measurement.protocol.Measurement`.
    """

    midpoint_reduction = True  # the last backward of the window's first half must reduce (leave `no_sync`)

    @torch.no_grad()
    def set_aside(self, params: Sequence[Tensor]) -> None:
        """Copy the first half's gradient shards; the parameters keep them, as FSDP1 expects."""
        self.restore()
        with_grad = [p for p in params if p.grad is not None]
        if any(p.grad.shape != p.shape for p in with_grad):  # type: ignore[union-attr]
            # a gradient still unsharded: the midpoint's backward did not reduce (its `training_step` returned
            # None and skipped it). Only this rank's samples are in it; the window goes unmeasured, as a window
            # whose halves cannot be compared does.
            return
        copies = _compat.foreach_copy([p.grad for p in with_grad])  # type: ignore[misc]
        self._first = list(zip(with_grad, copies, strict=True))

    def restore(self) -> None:
        """Forget the copy: the parameters' gradients hold all of both halves already."""
        for _, first in self._first:
            if first.is_cuda:  # freed while the copy may still be queued on a stream that made it
                first.record_stream(torch.cuda.current_stream(first.device))
        self._first = []

    @torch.no_grad()
    def combine(self, params: Sequence[Tensor]) -> Tensor:
        """``[s.s, s.r, r.r]`` of the two halves as a device tensor; the gradients are left as they are."""
        firsts, windows = [], []
        aside = set()
        for p, first in self._first:
            aside.add(id(p))
            if p.grad is None:
                raise RuntimeError(
                    f"a parameter of shape {tuple(p.shape)} had a gradient at the window's midpoint and none at its"
                    " end; FSDP1 keeps the reduced gradient, so something cleared it in between"
                )
            firsts.append(first)
            windows.append(p.grad)
        second_only = [p.grad for p in params if id(p) not in aside and p.grad is not None]
        seconds = _compat.foreach_sub(windows, firsts) if firsts else []
        # `seconds` are scratch: the addition back into them (what plain accumulation does) yields |s + r|^2
        products = gram_and_add_all_(firsts, seconds, (), second_only)
        self._release_read()
        self._read, self._first = firsts + seconds, []
        return products
