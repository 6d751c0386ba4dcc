r"""Half-batch statistics on one process: the two halves of the accumulation window.

Gradients accumulate over the window's micro-batches. With every sample weighed by :math:`1/N`
(see :mod:`lightning_simigrad.integration.accumulation`), the sum over the first half's micro-batches is
:math:`s = (n_A / N)\, g_A` and over the second half's :math:`r = (n_B / N)\, g_B`.

At the window's midpoint (:meth:`~WindowHalvesMeasurement.start_micro_batch` of its second half) the
measurement takes the accumulated gradient tensors off the parameters (``p.grad = None``: a move, no
copy), so the second half accumulates on its own -- its first backward even skips the addition plain
accumulation would do. At the window's last
backward (:meth:`~WindowHalvesMeasurement.after_backward`) it takes the norms of both halves, adds
:math:`s` back into the gradient (the addition plain accumulation does anyway) and takes the norms of the
sums, from which :math:`s \cdot s`, :math:`s \cdot r` and :math:`r \cdot r` follow, so the optimizer
steps with exactly :math:`s + r = g`. The set-aside tensors are the one gradient-sized buffer this costs;
the extra memory traffic is three reads of the gradient.

This happens after the window's last backward, before a ``GradScaler`` unscales the gradient and checks
it for overflow, so both halves carry the same loss scale (``collect`` takes it out of the products) and
an overflow in either half makes the scaler skip the step.

On CUDA everything here runs on the current stream of the training loop, where the backward left the
gradients. A set-aside tensor was made by the backward's stream, though, and a user's model may run
parts of its backward on other streams: a set-aside tensor is
kept until the products have been read to the host (:meth:`~WindowHalvesMeasurement.collect`, with the
loss scale when it is a tensor: the one host synchronisation), which waits for every op that read it; only
an abandoned window marks its tensors as read on the current stream (``record_stream``) instead.

The products and the re-joining addition are a constant number of fused multi-tensor ops, whatever the
number of parameter tensors (:func:`~lightning_simigrad.measurement._dots.gram_and_add_all_`): norms
accumulated in float32, summed in float64 (float32 on MPS), accurate to about :math:`10^{-6}` in the
similarity; ``benchmarks/launches.py`` counts the ops.

A window abandoned after its midpoint (:meth:`~WindowHalvesMeasurement.abort`) gets its first half back:
the gradient is then what plain accumulation leaves, and the next window's ``zero_grad`` clears it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_simigrad import _compat
from lightning_simigrad.core.plan import Window
from lightning_simigrad.core.statistics import HalfStats
from lightning_simigrad.measurement._dots import gram_and_add_all_
from lightning_simigrad.measurement.protocol import LossScale

__all__ = ["WindowHalvesMeasurement", "halves_of"]


class WindowHalvesMeasurement:
    """One process: the first half's gradient kept aside at a window's midpoint, compared and re-joined at its end.

    Implements :class:`~lightning_simigrad.measurement.protocol.Measurement`.
    """

    min_micro_batches = 2  # two halves in time
    midpoint_reduction = False  # one process, or FSDP2 (which reduces every micro-batch)

    def __init__(self) -> None:
        self._first: list[tuple[Tensor, Tensor]] = []
        # set-aside tensors the queued products still read, dropped once collect() has read them to the host
        self._read: list[Tensor] = []
        # the last backward's products [s.s, s.r, r.r] on the device, with n_A, n_B and the window's N
        self._products: tuple[Tensor, int, int, int] | None = None

    @property
    def holds_first_half(self) -> bool:
        return bool(self._first)

    # ------------------------------------------------------------------------------ the protocol
    def start_micro_batch(self, window: Window, index: int, params: Sequence[Tensor]) -> None:
        if index == 0:
            # a first half still held belongs to a window the loop abandoned (an epoch ended inside it, by -1 from
            # `on_train_batch_start` or a StopIteration): Lightning drops such a window, zeroing its gradient as the
            # next window starts, so it is given back here and never added into this window
            self.abort()
        if index == window.half_split() and index > 0:
            # set aside before the second half's first backward (after any skipped micro-batch too)
            self.set_aside(params)

    def after_backward(self, window: Window, index: int, fed: tuple[int, int], params: Sequence[Tensor]) -> None:
        if index == window.num_micro_batches - 1 and self._first:
            # the window's last backward, before a GradScaler unscales and checks the gradient: both halves
            # are still scaled alike. Each half is the mean of the samples it fed.
            self._products = (self.combine(params), fed[0], fed[1], window.total)

    def collect(self, loss_scale: LossScale) -> HalfStats | None:
        self.restore()  # the last micro-batch was skipped: re-join the halves, unmeasured
        measured, self._products = self._products, None
        if measured is None:
            self._release_read()
            return None
        products, n_a, n_b, total = measured
        if isinstance(loss_scale, Tensor):
            products = torch.cat([products, loss_scale.detach().reshape(1).to(products)])
        values = products.tolist()  # the one host synchronisation
        self._read = []  # every op that read the set-aside tensors is done: free them, no record_stream needed
        ss, sr, rr = values[:3]
        scale = values[3] if isinstance(loss_scale, Tensor) else float(loss_scale or 1.0)
        return halves_of(ss, sr, rr, n_a, n_b, total, scale)

    def abort(self) -> None:
        self.restore()
        self._release_read()  # the products were never read to the host: mark what they read, then forget it
        self._products = None

    def close(self) -> None:
        self.abort()

    # ------------------------------------------------------------------------------ the halves
    def set_aside(self, params: Sequence[Tensor]) -> None:
        """Take the accumulated gradients off ``params``; the next backward starts the second half."""
        self.restore()
        for p in params:
            if p.grad is not None:
                self._first.append((p, p.grad))
                p.grad = None

    @torch.no_grad()
    def restore(self) -> None:
        """Add the first half back without measuring (a window ended early, or teardown)."""
        pairs = []
        for p, first in self._first:
            if p.grad is None:
                p.grad = first
            else:
                pairs.append((p.grad, first))
        if pairs:
            storage = self.storage
            _compat.foreach_add_([storage(g) for g, _ in pairs], [storage(f) for _, f in pairs])
            for _, first in pairs:  # rare (an abandoned window): one call per tensor is fine here
                _read_on_current_stream(storage(first))
        self._first = []

    @torch.no_grad()
    def combine(self, params: Sequence[Tensor]) -> Tensor:
        """``[s.s, s.r, r.r]`` of the two halves as a device tensor; leaves ``p.grad`` holding ``s + r``.

        A constant number of fused ops whatever the number of parameter tensors
        (:func:`~lightning_simigrad.measurement._dots.gram_and_add_all_`; its docstring argues the precision).
        The set-aside tensors are kept until :meth:`collect` has read the products to the host: that read
        waits for every op queued on the current stream, so they can then be freed whatever stream made
        them, without a ``record_stream`` per tensor.
        """
        firsts, seconds, first_only, second_only = [], [], [], []
        aside = set()
        for p, first in self._first:  # attribute reads only: no ATen op per tensor
            aside.add(id(p))
            if p.grad is None:  # no gradient in the second half
                p.grad = first
                first_only.append(first)
            else:
                firsts.append(first)
                seconds.append(p.grad)
        for p in params:  # a gradient only in the second half
            if id(p) not in aside and p.grad is not None:
                second_only.append(p.grad)
        weights = self.weights(firsts, seconds, first_only, second_only)  # read off the gradients themselves
        storage = self.storage
        firsts, seconds, first_only, second_only = (
            [storage(t) for t in pieces] for pieces in (firsts, seconds, first_only, second_only)
        )
        products = gram_and_add_all_(firsts, seconds, first_only, second_only, weights)
        self._release_read()
        self._read, self._first = firsts, []
        return products

    @staticmethod
    def storage(grad: Tensor) -> Tensor:
        """The tensor a gradient's values live in, which the products read and the re-joining adds into."""
        return grad

    def weights(
        self,
        firsts: Sequence[Tensor],
        seconds: Sequence[Tensor],
        first_only: Sequence[Tensor],
        second_only: Sequence[Tensor],
    ) -> Tensor | None:
        """How much each gradient tensor's products count (the layout of
        :func:`~lightning_simigrad.measurement._dots.norm_weights`), or None when every tensor counts once: on
        one process each tensor is a whole gradient of its own."""
        return None

    def _release_read(self) -> None:
        """Forget set-aside tensors still held for the products' reads, marking them where that is needed."""
        for first in self._read:
            _read_on_current_stream(first)
        self._read = []


def halves_of(ss: float, sr: float, rr: float, n_a: int, n_b: int, total: int, scale: float) -> HalfStats:
    """The halves' statistics from the products of their accumulated sums ``s`` and ``r`` (every sample weighed
    by ``1 / total``, the loss scaled by ``scale``): :math:`g_A = (N / n_A) s / scale`, :math:`g_B = (N / n_B) r /
    scale`."""
    fa, fb = total / n_a / scale, total / n_b / scale
    return HalfStats(dot=sr * fa * fb, sq_a=ss * fa * fa, sq_b=rr * fb * fb, n_a=n_a, n_b=n_b)


def _read_on_current_stream(tensor: Tensor) -> None:
    if tensor.is_cuda:
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
