r"""Half-batch statistics on one process: the two halves of the accumulation window.

Gradients accumulate over the window's micro-batches. With every sample weighed by :math:`1/N`
(see :mod:`lightning_simigrad.accumulation`), the sum over the first half's micro-batches is
:math:`s = (n_A / N)\, g_A` and over the second half's :math:`r = (n_B / N)\, g_B`.

At the window's midpoint :meth:`WindowHalvesMeasurement.set_aside` takes the accumulated gradient
tensors off the parameters (``p.grad = None``: a move, no copy), so the second half accumulates on its
own -- its first backward even skips the addition plain accumulation would do. At the window's last
backward :meth:`~WindowHalvesMeasurement.combine` reads each pair once, chunk by chunk, for
:math:`s \cdot s`, :math:`s \cdot r`, :math:`r \cdot r` and adds :math:`s` back into the gradient in
the same pass, so the optimizer steps with exactly :math:`s + r = g`. The halves are kept apart, so
their products carry no cancellation error; the memory traffic equals the addition that plain
accumulation does anyway, and the set-aside tensors are the one gradient-sized buffer this costs.

This happens in ``on_after_backward``, before a ``GradScaler`` unscales the gradient and checks it for
overflow, so both halves carry the same loss scale (``inv_scale`` removes it from the products) and an
overflow in either half makes the scaler skip the step.

On CUDA everything here runs on the current stream of the training loop, where the backward left the
gradients. A set-aside tensor was made by the backward's stream, though, and a user's model may run
parts of its backward on other streams: before such a tensor is dropped (re-joined or restored) it is
marked as read on the current stream, so the caching allocator cannot reuse its memory while the
products and the addition that read it are still queued. The products are summed on the device and read
to the host once, with the loss scale when it is given as a tensor (one host synchronisation).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_simigrad._dots import gram_and_add_, square
from lightning_simigrad.statistics import HalfStats

__all__ = ["WindowHalvesMeasurement"]


class WindowHalvesMeasurement:
    """Keep the first half's gradient aside at a window's midpoint; compare and re-join at its end."""

    def __init__(self) -> None:
        self._first: list[tuple[Tensor, Tensor]] = []

    @property
    def holds_first_half(self) -> bool:
        return bool(self._first)

    def set_aside(self, params: list[Tensor]) -> None:
        """Take the accumulated gradients off ``params``; the next backward starts the second half."""
        self.restore()
        for p in params:
            if p.grad is not None:
                self._first.append((p, p.grad))
                p.grad = None

    def discard(self) -> None:
        """Drop a first half still held: its window was abandoned (an epoch ended inside it), and Lightning drops
        such a window's gradient, zeroing it as the next window starts."""
        for _, first in self._first:
            _read_on_current_stream(first)
        self._first = []

    @torch.no_grad()
    def restore(self) -> None:
        """Add the first half back without measuring (a window Lightning ended early, or teardown)."""
        for p, first in self._first:
            if p.grad is None:
                p.grad = first
            else:
                p.grad.add_(first)
                _read_on_current_stream(first)
        self._first = []

    @torch.no_grad()
    def combine(
        self,
        params: list[Tensor],
        n_a: int,
        n_b: int,
        inv_scale: float | Tensor = 1.0,
        total: int | None = None,
    ) -> HalfStats:
        """Statistics of the two halves; leaves ``p.grad`` holding the whole window's gradient.

        ``total`` is the window's planned :math:`N` (each sample weighed ``1/N``); it exceeds
        ``n_a + n_b`` when a micro-batch was skipped (``training_step`` returned None).
        ``inv_scale`` (a float, or a tensor read in the same transfer as the products) removes a loss
        scale from the statistics.
        """
        parts = []
        aside = set()
        for p, first in self._first:
            aside.add(id(p))
            if p.grad is None:  # no gradient in the second half
                p.grad = first
                ss = square(first)
                parts.append(torch.stack([ss, torch.zeros_like(ss), torch.zeros_like(ss)]))
            else:
                parts.append(gram_and_add_(first, p.grad))
                _read_on_current_stream(first)
        for p in params:  # a gradient only in the second half
            if id(p) not in aside and p.grad is not None:
                rr = square(p.grad)
                parts.append(torch.stack([torch.zeros_like(rr), torch.zeros_like(rr), rr]))
        self._first = []
        products = torch.stack(parts).sum(0) if parts else torch.zeros(3, dtype=torch.float64)
        if isinstance(inv_scale, Tensor):
            products = torch.cat([products, inv_scale.detach().reshape(1).to(products)])
        values = products.tolist()  # the one host synchronisation
        ss, sr, rr = values[:3]
        scale = values[3] if isinstance(inv_scale, Tensor) else float(inv_scale)
        total = n_a + n_b if total is None else total
        fa, fb = total / n_a * scale, total / n_b * scale  # g_A = fa s, g_B = fb r, unscaled
        return HalfStats(dot=sr * fa * fb, sq_a=ss * fa * fa, sq_b=rr * fb * fb, n_a=n_a, n_b=n_b)


def _read_on_current_stream(tensor: Tensor) -> None:
    if tensor.is_cuda:
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
