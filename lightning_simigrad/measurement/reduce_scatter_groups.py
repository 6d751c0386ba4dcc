r"""Two groups of ranks inside FSDP1's reduce-scatter: the halves on an even number of ranks.

Under Lightning's ``FSDPStrategy`` a window's micro-batches accumulate inside FSDP1's ``no_sync``; at the last
backward each FSDP unit reduce-scatters its flat, padded, unsharded gradient :math:`h_r` of every rank
:math:`r` into the ranks' shards of :math:`g = \frac1W \sum_r h_r` (rank :math:`r` gets chunk :math:`r` of
:math:`W` equal chunks). As under DDP (:mod:`~lightning_simigrad.measurement.rank_groups`), the halves are two
groups of ranks, A = ranks :math:`0 .. W/2-1` and B = the rest, and with every sample weighed by :math:`1/N`
their shares :math:`u = \frac1W \sum_{r \in A} h_r = \frac{n_A}{N} g_A` and :math:`v = \frac1W \sum_{r \in B}
h_r` give :math:`|g_A|^2`, :math:`|g_B|^2` and :math:`g_A \cdot g_B` from :math:`u \cdot u`, :math:`u \cdot v`,
:math:`v \cdot v` (:func:`~lightning_simigrad.measurement.composed.halves_of`).

This measurement replaces the reduce-scatter with two stages that move the same bytes (FSDP1's
``register_comm_hook``; the hook then does FSDP1's pre- and post-division itself, as its default hook does):

1. within each group (:math:`W/2` ranks), a reduce-scatter of the gradient laid out as super-chunks
   :math:`j = (\text{chunk } j, \text{chunk } W/2 + j)`: rank :math:`j` of A gets super-chunk :math:`j` of
   :math:`u`, rank :math:`W/2 + j` of B the same super-chunk of :math:`v`. Sent per rank:
   :math:`(1 - 2/W) P`. At :math:`W = 2` the groups are single ranks and this stage is nothing.
2. between the partners :math:`j` and :math:`W/2 + j`, an all-to-all of halves: each sends the half of its
   super-chunk the other's shard needs (:math:`P/W`) and keeps the other. Rank :math:`j` then holds chunk
   :math:`j` of both :math:`u` and :math:`v`, rank :math:`W/2 + j` chunk :math:`W/2 + j` of both -- exactly
   the shard FSDP1 gives it.

Each rank takes :math:`[u \cdot u, u \cdot v, v \cdot v]` over its chunk (no cancellation: the products of
the shares themselves) and writes :math:`u + v` as its shard. Per rank :math:`(1 - 2/W) P + P/W = (1 - 1/W) P`
elements are sent, what one flat reduce-scatter sends: **no extra gradient traffic**, one more collective
per unit (two at :math:`W \ge 4`, one at 2) and, at :math:`W \ge 4`, a copy of the unit's gradient into the
super-chunk order (transient, one unit's unsharded gradient). The products cross ranks in one all-gather of a row
per rank (:mod:`~lightning_simigrad.measurement.rows`). They are taken in the reduce dtype, accumulated in float32
and summed in float64, as on one process; ``docs/distributed.md`` gives the measured bytes and precision.

The shard equals FSDP1's own up to the order of the additions (the group sums first). A rank whose products
fail still runs every collective (the error reaches every rank in ``collect``); a collective that fails fails
this rank's backward, where the backend reports it. An odd number of ranks has no partners: there the halves in
time serve instead, with the gradient reduced at the window's midpoint too
(:mod:`~lightning_simigrad.measurement.time_halves`, :class:`~lightning_simigrad.measurement.time_halves.CopyAside`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_simigrad.core.plan import Window
from lightning_simigrad.measurement._dots import gram
from lightning_simigrad.measurement.composed import Finished
from lightning_simigrad.measurement.protocol import Attachment
from lightning_simigrad.measurement.rows import Outcome
from lightning_simigrad.measurement.sharding import check_fsdp1_units

__all__ = ["ReduceScatterGroups", "predivide_factor"]


class ReduceScatterGroups:
    """FSDP1, even :math:`W`: the two rank groups' shares of every shard, from a two-stage reduce-scatter.

    :meth:`attach` makes the groups and puts the hook on the FSDP1 root before the first training step.
    """

    name = "FSDP"
    min_micro_batches = 1  # the halves are groups of ranks: one micro-batch per rank suffices
    midpoint_reduction = False  # measured in the window's one reduction

    def __init__(self) -> None:
        self._world, self._rank = dist.get_world_size(), dist.get_rank()
        if self._world % 2:
            raise ValueError(f"two rank groups of equal size need an even number of ranks, got {self._world}")
        self._half = self._world // 2
        self._group: dist.ProcessGroup | None = None  # this rank's group, A or B (None at W = 2)
        self._pair: dist.ProcessGroup | None = None  # this rank and its partner in the other group
        self._armed: tuple[int, int, int] | None = None  # n_A, n_B, N of the window whose last backward runs
        self._partials: list[Tensor] = []  # [u.u, u.v, v.v] of every unit reduced so far in that backward
        self._failure: BaseException | None = None  # a unit's products failed on this rank
        self._products: Finished | None = None

    def attach(self, target: Attachment) -> None:
        """Make the groups (a collective: every rank, in the same order) and reduce through them from now on.

        Raises:
            RuntimeError: the model has a communication hook of someone else's (FSDP1 takes one).
        """
        check_fsdp1_units(target)
        root = target.model
        half, rank = self._half, self._rank
        for j in range(half):  # new_group is called by every rank for every group, in one order
            pair = _new_group([j, half + j])
            if rank in (j, half + j):
                self._pair = pair
        if half > 1:
            groups = [_new_group(list(range(half))), _new_group(list(range(half, self._world)))]
            self._group = groups[rank >= half]
        relay = _RELAYS.get(root)
        if relay is None:  # FSDP1 takes one hook, for good: a later fit on the same model re-points ours
            relay = _Relay()
            try:
                root.register_comm_hook(state=None, hook=relay)
            except AssertionError as error:
                raise RuntimeError(
                    f"SimiGrad measures FSDP1 inside its reduce-scatter, through a communication hook, and this model"
                    f" has one already ({error}). Remove `register_comm_hook` from your code."
                ) from error
            _RELAYS[root] = relay
        relay.target = self

    def half_of(self, window: Window, index: int) -> int:
        return int(self._rank >= self._half)  # group A: the first W / 2 ranks

    def start_micro_batch(self, window: Window, index: int, params: Sequence[Tensor]) -> None:
        if index == 0:
            self.abort()  # a window the loop abandoned: nothing of it is reported
        if index == window.num_micro_batches - 1:  # the backward that reduces (the others run in `no_sync`)
            per_rank = window.samples_per_rank()
            n_a, n_b = sum(per_rank[: self._half]), sum(per_rank[self._half :])
            # a tiny epoch may leave one rank group without samples: nothing to compare
            self._armed = (n_a, n_b, window.total) if n_a and n_b else None
            self._partials = []

    def after_backward(self, window: Window, index: int, fed: tuple[int, int], params: Sequence[Tensor]) -> None:
        last = index == window.num_micro_batches - 1
        if last and self._armed is not None and self._partials and self._failure is None:
            post = self._world / predivide_factor(self._world)
            # the hook's shares are pre-divided only: u = (their sum) / post, likewise v
            self._products = Finished(torch.stack(self._partials).sum(dim=0) / (post * post), self._armed)
        self._armed, self._partials = None, []

    def finish(self) -> Finished:
        measured, self._products = self._products, None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            return Finished(None, None, Outcome.COMBINE, cause=failure)
        return measured if measured is not None else Finished(None, None)

    def after_read(self) -> None:
        pass

    @staticmethod
    def shares(sums: tuple[float, float, float, float]) -> tuple[float, float, float]:
        return sums[0], sums[1], sums[2]

    def abort(self) -> None:
        self._armed, self._partials, self._products, self._failure = None, [], None, None

    def close(self) -> None:
        self.abort()

    @torch.no_grad()
    def reduce(self, grad: Tensor, output: Tensor) -> None:
        """FSDP1's reduce-scatter of one unit's padded flat gradient ``grad`` into this rank's shard ``output``."""
        world, half = self._world, self._half
        chunk = grad.numel() // world
        pre = predivide_factor(world)
        if pre > 1:  # as FSDP1's own hook divides: before the sum (against overflow in low precision), and after
            grad.div_(pre)
        mine = grad
        if half > 1:
            order = grad.view(2, half, chunk).transpose(0, 1).reshape(-1)  # super-chunk j: chunks j, half + j
            mine = grad.new_empty(2 * chunk)
            dist.reduce_scatter_tensor(mine, order, group=self._group)
            del order
        both = grad.new_empty(2 * chunk)
        dist.all_to_all_single(both, mine, group=self._pair)  # [u, v] of this rank's chunk, A's and B's alike
        u, v = both[:chunk], both[chunk:]
        if self._armed is not None and self._failure is None:
            try:
                self._partials.append(gram(u, v))
            except Exception as error:  # reported to every rank by collect(); the reduction goes on
                self._failure = error
        torch.add(u, v, out=output)
        if world / pre > 1:
            output.div_(world / pre)


def predivide_factor(world: int) -> float:
    """FSDP1's division before its reduce-scatter (its own rule: double from 1 while the factor divides :math:`W`
    and is below :math:`W` over it); the rest, :math:`W / f`, is divided after it.

    >>> [predivide_factor(w) for w in (2, 4, 6, 8, 16)]
    [2.0, 2.0, 4.0, 4.0, 4.0]
    """
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return float(factor)


def _new_group(ranks: list[int]) -> dist.ProcessGroup | None:
    group = dist.new_group(ranks)
    return group if isinstance(group, dist.ProcessGroup) else None  # a rank outside the group gets a marker


class _Relay:
    """The hook FSDP1 keeps: forwards every reduction to the measurement of the current fit."""

    target: ReduceScatterGroups

    def __call__(self, state: object, grad: Tensor, output: Tensor) -> None:
        self.target.reduce(grad, output)


_RELAYS: weakref.WeakKeyDictionary[Any, _Relay] = weakref.WeakKeyDictionary()
