r"""The statistics of two half-batch gradients, and what they say about the ideal batch size.

Split a batch of :math:`B` samples into halves :math:`A` and :math:`B'` with :math:`n_A + n_B = B`
samples and mean gradients :math:`g_A, g_B`. With :math:`G` the true gradient and :math:`\Sigma` the
per-sample gradient covariance:

.. math::

    E[g_A \cdot g_B] = |G|^2, \qquad E|g_A|^2 = |G|^2 + \frac{\operatorname{tr}\Sigma}{n_A}.

With equal halves the cosine similarity is :math:`E[\cos(g_A, g_B)] \approx 1 / (1 + 2 B_{noise}/B)`
where :math:`B_{noise} = \operatorname{tr}\Sigma / |G|^2` is McCandlish et al.'s simple noise scale,
so a target similarity :math:`\tau` is met at :math:`B^* = 2 B_{noise} \tau / (1 - \tau)`.

Everything here is pure arithmetic on Python floats: the measurement modules reduce the gradients to
the five numbers of :class:`HalfStats`, and the controller works from those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["HalfStats", "equilibrium_batch_size", "expected_similarity"]


@dataclass(frozen=True)
class HalfStats:
    """Dot products of the two half-batch mean gradients of one optimizer step.

    Args:
        dot: :math:`g_A \\cdot g_B`.
        sq_a: :math:`|g_A|^2`.
        sq_b: :math:`|g_B|^2`.
        n_a: samples behind :math:`g_A`.
        n_b: samples behind :math:`g_B`.

    Example::

        >>> s = HalfStats(dot=3.0, sq_a=5.0, sq_b=5.0, n_a=4, n_b=4)
        >>> s.similarity
        0.6
        >>> s.grad_sq, s.trace_sigma   # |G|^2 ~ 3, tr(Sigma) ~ |g_A - g_B|^2 / (1/4 + 1/4) = 4 / 0.5
        (3.0, 8.0)
    """

    dot: float
    sq_a: float
    sq_b: float
    n_a: int
    n_b: int

    @property
    def batch_size(self) -> int:
        return self.n_a + self.n_b

    @property
    def similarity(self) -> float:
        """Cosine similarity of the two halves; NaN, never an error, unless both squared norms are positive.

        A norm can come out zero (a half without gradient) or, measured by difference under DDP at W >= 3,
        a few ulps below zero when one group's gradient is nearly nothing.

        >>> HalfStats(dot=1.0, sq_a=-1e-30, sq_b=4.0, n_a=2, n_b=2).similarity
        nan
        """
        if not (self.sq_a > 0 and self.sq_b > 0):  # also False for NaN
            return math.nan
        return self.dot / math.sqrt(self.sq_a * self.sq_b)

    @property
    def grad_sq(self) -> float:
        """Unbiased estimate of :math:`|G|^2` (it can be negative when the noise dominates)."""
        return self.dot

    @property
    def trace_sigma(self) -> float:
        """Unbiased estimate of :math:`\\operatorname{tr}\\Sigma` from :math:`|g_A - g_B|^2`."""
        diff_sq = max(self.sq_a + self.sq_b - 2.0 * self.dot, 0.0)  # >= 0 exactly; rounding can dip below
        return diff_sq / (1.0 / self.n_a + 1.0 / self.n_b)

    @property
    def is_finite(self) -> bool:
        """False for an overflowed (mixed precision) or empty measurement: such a step is not acted on."""
        return (
            self.n_a > 0
            and self.n_b > 0
            and all(math.isfinite(v) for v in (self.dot, self.sq_a, self.sq_b))
            and self.sq_a > 0
            and self.sq_b > 0
        )

    def scaled(self, factor: float) -> HalfStats:
        """The same statistics for gradients multiplied by ``factor`` (e.g. ``1 / loss_scale``)."""
        f2 = factor * factor
        return HalfStats(self.dot * f2, self.sq_a * f2, self.sq_b * f2, self.n_a, self.n_b)


def expected_similarity(batch_size: float, noise_scale: float) -> float:
    """Expected cosine similarity of two equal halves of a batch, :math:`1 / (1 + 2 B_{noise} / B)`.

    >>> expected_similarity(batch_size=800, noise_scale=100)
    0.8
    """
    if batch_size <= 0:
        raise ValueError(f"`batch_size` must be positive, got {batch_size}.")
    return 1.0 / (1.0 + 2.0 * noise_scale / batch_size)


def equilibrium_batch_size(noise_scale: float, target_similarity: float) -> float:
    """The batch size :math:`B^* = 2 B_{noise} \\tau / (1 - \\tau)` at which the halves' similarity is ``tau``.

    >>> round(equilibrium_batch_size(noise_scale=100, target_similarity=0.8), 9)
    800.0
    """
    if not -1.0 < target_similarity < 1.0:
        raise ValueError(f"`target_similarity` must lie in (-1, 1), got {target_similarity}.")
    return 2.0 * noise_scale * target_similarity / (1.0 - target_similarity)
