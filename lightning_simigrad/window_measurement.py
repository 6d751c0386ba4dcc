r"""Half-batch statistics on one process: the two halves of the accumulation window.

Gradients accumulate over the window's micro-batches. With every sample weighed by :math:`1/N`
(see :mod:`lightning_simigrad.accumulation`), the gradient after the first half's micro-batches is
:math:`s = (n_A / N)\, g_A` and after the whole window it is :math:`t = g`, the full mean. So one
snapshot of the gradient at the midpoint gives both halves:

.. math::

    g_A = \frac{N}{n_A}\, s, \qquad g_B = \frac{N}{n_B}\, (t - s).

The snapshot is the only gradient-sized buffer this costs (allocated once, filled with one fused
``_foreach_copy_`` per window). The dot products :math:`s \cdot s`, :math:`s \cdot t`,
:math:`t \cdot t` are taken tensor by tensor straight from the buffers, so no flat copy of the
gradient and no temporary is ever made; the second half's products follow from them. Under a
``GradScaler`` the snapshot holds scaled gradients while the window's end is read after unscaling:
``inv_scale`` brings them to the same units.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_simigrad._dots import gram
from lightning_simigrad.statistics import HalfStats

__all__ = ["WindowHalvesMeasurement"]


class WindowHalvesMeasurement:
    """Snapshot the gradient at a window's midpoint; compare the halves at its end."""

    def __init__(self) -> None:
        self._buffers: list[Tensor] = []
        self._params: list[Tensor] = []
        self._taken = False

    def reset(self) -> None:
        """Forget the snapshot (a new window started)."""
        self._taken = False

    @property
    def has_snapshot(self) -> bool:
        return self._taken

    def snapshot(self, params: list[Tensor]) -> None:
        """Copy the accumulated gradients of ``params`` (those that have one) into the buffer."""
        with_grad = [p for p in params if p.grad is not None]
        grads = [p.grad for p in with_grad]
        if len(with_grad) != len(self._params) or any(a is not b for a, b in zip(with_grad, self._params)):
            self._params = with_grad
            self._buffers = [torch.empty_like(g) for g in grads]  # type: ignore[arg-type]
        torch._foreach_copy_(self._buffers, grads)  # type: ignore[arg-type]
        self._taken = True

    @torch.no_grad()
    def collect(self, n_a: int, n_b: int, inv_scale: float = 1.0) -> HalfStats | None:
        """Statistics of the halves from the snapshot and the current (end-of-window) gradients."""
        if not self._taken:
            return None
        self._taken = False
        total = n_a + n_b
        # the second half is t - s: its products follow from s.s, s.t and t.t (both halves carry
        # comparable weight, so the subtraction costs only a few ulps)
        dots = [gram(snap, param.grad) for param, snap in zip(self._params, self._buffers) if param.grad is not None]
        ss, st, tt = torch.stack(dots).sum(0).tolist()  # one device sync per window
        ss, st = ss * inv_scale * inv_scale, st * inv_scale
        dot, rr = st - ss, tt - 2.0 * st + ss
        fa, fb = total / n_a, total / n_b
        return HalfStats(dot=dot * fa * fb, sq_a=ss * fa * fa, sq_b=max(rr, 0.0) * fb * fb, n_a=n_a, n_b=n_b)
