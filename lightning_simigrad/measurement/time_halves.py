r"""Halves in time: the window's first micro-batches against the rest, on the gradient each rank accumulates.

Gradients accumulate over the window's micro-batches. With every sample weighed by :math:`1/N`
(:mod:`lightning_simigrad.integration.accumulation`), the sum over the first half's micro-batches is
:math:`s = (n_A / N)\, g_A` and over the second half's :math:`r = (n_B / N)\, g_B`. :class:`TimeHalves` keeps
the two apart from the window's midpoint to its last backward, takes :math:`s \cdot s`, :math:`s \cdot r`,
:math:`r \cdot r` there, and leaves the gradient the optimizer steps with exactly :math:`s + r`. It serves:

- **one process**: the whole gradient is the rank's (:class:`LocalPieces`);
- **FSDP2** (``fully_shard`` under ``ModelParallelStrategy``): FSDP2 reduces every micro-batch, so each rank's
  ``p.grad`` shard already holds every rank's samples, and the products of the whole gradients are sums of the
  ranks' local products (:class:`~lightning_simigrad.measurement.sharding.ShardedPieces` reads each shard and
  weighs pieces held alike by several ranks);
- **FSDP1 on an odd number of ranks**: Lightning accumulates inside ``no_sync``, so the last backward of the
  window's first half is let out of it (:attr:`TimeHalves.midpoint_reduction`) and reduce-scatters :math:`s`.

How the first half is kept is the one thing that differs (:class:`MoveAside`, :class:`CopyAside`). Every
product and the re-joining addition are a constant number of fused multi-tensor ops, whatever the number of
parameter tensors (:func:`~lightning_simigrad.measurement._dots.gram_and_add_all_`): norms accumulated in float32,
summed in float64 (float32 on MPS), about :math:`10^{-6}` in the similarity.

This happens after the window's last backward, before a ``GradScaler`` unscales the gradient and checks it for
overflow, so both halves carry the same loss scale (the collect takes it out) and an overflow in either half
makes the scaler skip the step. On CUDA everything runs on the training loop's current stream. A set-aside
tensor was made by the backward's stream, and a model may run parts of its backward on other streams: set-aside
tensors are kept until the products have been read to the host (:meth:`TimeHalves.after_read`), which waits for
every op that read them; only an abandoned window marks its tensors as read on the current stream
(``record_stream``) instead. A window abandoned after its midpoint gets its first half back: the gradient is then
what plain accumulation leaves, and the next window's ``zero_grad`` clears it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from lightning_simigrad import _compat
from lightning_simigrad.core.plan import Window
from lightning_simigrad.measurement._dots import HalfTensors, gram_and_add_all_
from lightning_simigrad.measurement.composed import Finished
from lightning_simigrad.measurement.protocol import Attachment

__all__ = ["CopyAside", "InTime", "LocalPieces", "MoveAside", "Pieces", "TimeHalves"]


class Pieces(Protocol):
    """How the measurement reads a rank's gradient tensors."""

    def storage(self, grad: Tensor) -> Tensor:
        """The tensor a gradient's values live in, which the products read and the re-joining adds into."""

    def weights(self, halves: HalfTensors) -> Tensor | None:
        """How much each tensor's products count (the layout of
        :func:`~lightning_simigrad.measurement._dots.norm_weights`), or None when every tensor counts once."""


class LocalPieces:
    """Every gradient tensor whole and this rank's own: read as it is, counted once."""

    @staticmethod
    def storage(grad: Tensor) -> Tensor:
        return grad

    @staticmethod
    def weights(halves: HalfTensors) -> Tensor | None:
        return None


class MoveAside:
    """The first half's gradient taken off the parameters at the midpoint (a move, no copy), so the second half
    accumulates on its own: ``p.grad = None``, and the second half keeps its first backward's tensor, as plain
    accumulation keeps the first micro-batch's. At the end the first half's products are taken and it is added into
    the second half's gradient (the addition plain accumulation does anyway).

    Every backward writes a fresh tensor, in plain accumulation too (autograd adds it into ``p.grad`` or keeps it).
    So this allocates what plain allocates, as often, and moves no more bytes: the second half's first backward
    skips one of plain's additions and the join pays it back. What differs is that one more gradient-sized block
    lives through the second half, until the products have been read: the extra resident memory is one gradient,
    during the second half only.

    (A *spare* was tried and removed: the previous window's first-half buffers, kept between windows and set to -0.0
    for the second half to accumulate into, so that a window would free the blocks plain frees. Its fill and extra
    addition cost 4 gradients of traffic a window and one gradient held all the time; it paid against page faults on
    one host and cost on another. docs/measurement.md, "Where the cost sits".)
    """

    def set_aside(self, params: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
        first = []
        for p in params:
            grad = p.grad
            if grad is not None:
                first.append((p, grad))
                p.grad = None
        return first

    @torch.no_grad()
    def restore(self, pieces: Pieces, first: list[tuple[Tensor, Tensor]]) -> None:
        """Add the first half back without measuring (a window ended early, or teardown)."""
        pairs = []
        for p, kept in first:
            if p.grad is None:
                p.grad = kept
            else:
                pairs.append((p.grad, kept))
        if pairs:
            storage = pieces.storage
            _compat.foreach_add_([storage(g) for g, _ in pairs], [storage(f) for _, f in pairs])
            for _, kept in pairs:  # rare (an abandoned window): one call per tensor is fine here
                read_on_current_stream(storage(kept))

    @torch.no_grad()
    def combine(
        self, pieces: Pieces, first: list[tuple[Tensor, Tensor]], params: Sequence[Tensor]
    ) -> tuple[Tensor, list[Tensor]]:
        """``[s.s, s.r, r.r]`` as a device tensor, and the tensors the queued products read; leaves ``p.grad``
        holding ``s + r``."""
        firsts, seconds, first_only, second_only = [], [], [], []
        aside = set()
        for p, kept in first:  # attribute reads only: no ATen op per tensor
            aside.add(id(p))
            if p.grad is None:  # no gradient in the second half
                p.grad = kept
                first_only.append(kept)
            else:
                firsts.append(kept)
                seconds.append(p.grad)
        for p in params:  # a gradient only in the second half
            if id(p) not in aside and p.grad is not None:
                second_only.append(p.grad)
        weights = pieces.weights(HalfTensors(firsts, seconds, first_only, second_only))  # read off the gradients
        firsts, seconds, first_only, second_only = (
            [pieces.storage(t) for t in group] for group in (firsts, seconds, first_only, second_only)
        )
        return gram_and_add_all_(firsts, seconds, first_only, second_only, weights), firsts


class CopyAside:
    """FSDP1: the midpoint's backward reduce-scattered the first half into the parameters' gradient shards, which
    FSDP1 keeps and adds the second half into. So the first half's shards are copied (one fused op), and at the end
    the second half is taken as the window's gradient less the copy (one fused op); the gradient is never written."""

    @torch.no_grad()
    def set_aside(self, params: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
        with_grad = [p for p in params if p.grad is not None]
        if any(p.grad.shape != p.shape for p in with_grad):  # type: ignore[union-attr]
            # a gradient still unsharded: the midpoint's backward did not reduce (its `training_step` returned None
            # and skipped it). Only this rank's samples are in it; the window goes unmeasured.
            return []
        copies = _compat.foreach_copy([p.grad for p in with_grad])  # type: ignore[misc]
        return list(zip(with_grad, copies, strict=True))

    def restore(self, pieces: Pieces, first: list[tuple[Tensor, Tensor]]) -> None:
        """Forget the copy: the parameters' gradients hold all of both halves already."""
        for _, kept in first:
            read_on_current_stream(kept)  # freed while the copy may still be queued on a stream that made it

    @torch.no_grad()
    def combine(
        self, pieces: Pieces, first: list[tuple[Tensor, Tensor]], params: Sequence[Tensor]
    ) -> tuple[Tensor, list[Tensor]]:
        firsts, windows = [], []
        aside = set()
        for p, kept in first:
            aside.add(id(p))
            if p.grad is None:
                raise RuntimeError(
                    f"a parameter of shape {tuple(p.shape)} had a gradient at the window's midpoint and none at its"
                    " end; FSDP1 keeps the reduced gradient, so something cleared it in between"
                )
            firsts.append(kept)
            windows.append(p.grad)
        second_only = [p.grad for p in params if id(p) not in aside and p.grad is not None]
        seconds = _compat.foreach_sub(windows, firsts) if firsts else []
        # `seconds` are scratch: the addition back into them (what plain accumulation does) yields |s + r|^2
        return gram_and_add_all_(firsts, seconds, (), second_only), firsts + seconds


class InTime:
    """What every measurement of the halves in time shares: a window's first ``k // 2`` micro-batches against the
    rest, on every rank alike, and the products of the halves' shares summed over the ranks as they are."""

    min_micro_batches = 2  # two halves in time

    @staticmethod
    def half_of(window: Window, index: int) -> int:
        return int(index >= window.half_split())

    @staticmethod
    def shares(sums: tuple[float, float, float, float]) -> tuple[float, float, float]:
        return sums[0], sums[1], sums[2]


class TimeHalves(InTime):
    """The window's halves in time: ``k // 2`` micro-batches against the rest, on every rank alike.

    Args:
        name: what it measures on, for messages.
        pieces: how a gradient tensor is read (:class:`LocalPieces`, or sharded).
        aside: how the first half is kept (:class:`MoveAside`, :class:`CopyAside`).
        check: what :meth:`attach` checks of the wrapped model (None: nothing).
        midpoint_reduction: the last backward of the first half must reduce across ranks (FSDP1).
    """

    def __init__(
        self,
        name: str,
        pieces: Pieces,
        aside: MoveAside | CopyAside,
        check: Callable[[Attachment], None] | None = None,
        midpoint_reduction: bool = False,
    ) -> None:
        self.name, self.pieces, self.aside, self.check = name, pieces, aside, check
        self.midpoint_reduction = midpoint_reduction
        self._first: list[tuple[Tensor, Tensor]] = []
        # set-aside tensors the queued products still read, dropped once they have been read to the host
        self._read: list[Tensor] = []
        self._products: Finished | None = None  # the last backward's, until the window's end

    @property
    def holds_first_half(self) -> bool:
        return bool(self._first)

    def attach(self, target: Attachment) -> None:
        if self.check is not None:
            self.check(target)

    def start_micro_batch(self, window: Window, index: int, params: Sequence[Tensor]) -> None:
        if index == 0:
            # a first half still held belongs to a window the loop abandoned (an epoch ended inside it, by -1 from
            # `on_train_batch_start` or a StopIteration): Lightning drops such a window, zeroing its gradient as the
            # next window starts, so it is given back here and never added into this window
            self.abort()
        if index == window.half_split() and index > 0:
            # set aside before the second half's first backward (after any skipped micro-batch too)
            self.restore()
            self._first = self.aside.set_aside(params)

    def after_backward(self, window: Window, index: int, fed: tuple[int, int], params: Sequence[Tensor]) -> None:
        if index == window.num_micro_batches - 1 and self._first:
            # the window's last backward, before a GradScaler unscales and checks the gradient: both halves are
            # still scaled alike. Each half is the mean of the samples it fed.
            products, read = self.aside.combine(self.pieces, self._first, params)
            self._release_read()
            self._read, self._first = read, []
            self._products = Finished(products, (fed[0], fed[1], window.total))

    def finish(self) -> Finished:
        self.restore()  # the last micro-batch was skipped: re-join the halves, unmeasured
        measured, self._products = self._products, None
        if measured is None:
            self._release_read()
            return Finished(None, None)
        return measured

    def after_read(self) -> None:
        # every op that read the set-aside tensors is done: they may be freed
        self._read = []

    def abort(self) -> None:
        self.restore()
        self._release_read()  # the products were never read to the host: mark what they read, then forget it
        self._products = None

    def close(self) -> None:
        self.abort()

    def restore(self) -> None:
        """Give the first half back to the gradient, unmeasured."""
        first, self._first = self._first, []
        if first:
            self.aside.restore(self.pieces, first)

    def _release_read(self) -> None:
        """Forget set-aside tensors still held for the products' reads, marking them where that is needed."""
        for tensor in self._read:
            read_on_current_stream(tensor)
        self._read = []


def read_on_current_stream(tensor: Tensor) -> None:
    if tensor.is_cuda:
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
