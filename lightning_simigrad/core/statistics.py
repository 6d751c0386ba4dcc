r"""The statistics of two half-batch gradients, and what they say about the ideal batch size.

Split a batch of :math:`B` samples into halves :math:`A` and :math:`B'` with :math:`n_A + n_B = B`
samples and mean gradients :math:`g_A, g_B`. Let the epoch hold :math:`N` samples with per-sample
gradients :math:`g_i`, the true gradient :math:`G = \frac1N \sum_i g_i` and the per-sample covariance's
trace :math:`\operatorname{tr}\Sigma = \frac1N \sum_i |g_i - G|^2`. The sampler draws every window from
one permutation of the epoch, so the :math:`B` samples are drawn *without replacement*, and the two
halves are disjoint. For a sample mean of :math:`n` of the :math:`N` values,
:math:`\operatorname{Cov}(g_A) = \frac{\Sigma}{n_A}\frac{N - n_A}{N - 1}`, and two disjoint halves
have :math:`\operatorname{Cov}(g_A, g_B) = -\frac{\Sigma}{N - 1}` (each pair of distinct draws has
covariance :math:`-\Sigma/(N-1)`). Hence

.. math::

    E[g_A \cdot g_B] = |G|^2 - \frac{\operatorname{tr}\Sigma}{N - 1}, \qquad
    E|g_A|^2 = |G|^2 + \frac{\operatorname{tr}\Sigma}{n_A}\,\frac{N - n_A}{N - 1},

    E|g_A - g_B|^2 = \operatorname{tr}\Sigma\,\frac{N}{N - 1}\Big(\frac1{n_A} + \frac1{n_B}\Big).

With :math:`T = |g_A - g_B|^2 / (1/n_A + 1/n_B)` the unbiased estimates are therefore

.. math::

    \widehat{\operatorname{tr}\Sigma} = T\,\frac{N - 1}{N}, \qquad
    \widehat{|G|^2} = g_A \cdot g_B + \frac{\widehat{\operatorname{tr}\Sigma}}{N - 1} = g_A \cdot g_B + \frac{T}{N}.

For :math:`N \to \infty` (halves drawn with replacement, or independent data) these are the familiar
:math:`g_A \cdot g_B` and :math:`T`. Used with a finite dataset, those with-replacement forms estimate
:math:`B_{noise} = \operatorname{tr}\Sigma / |G|^2` biased by the factor
:math:`\frac{N}{N-1} / (1 - B_{noise}/(N - 1))`: 1.05 at :math:`B_{noise}/N = 0.05`, 2.07 at 0.52, and
undefined once :math:`B_{noise} \ge N - 1`.

The expected similarity of two equal halves (:math:`n_A = n_B = B/2`), as the ratio of the expectations
above, is

.. math::

    E[\cos(g_A, g_B)] \approx \frac{1 - B_{noise}/(N - 1)}{1 + \frac{2 B_{noise}}{B}\,\frac{N - B/2}{N - 1}}
    \;\xrightarrow{N \to \infty}\; \frac{1}{1 + 2 B_{noise}/B},

where :math:`B_{noise}` is McCandlish et al.'s simple noise scale, and a target similarity :math:`\tau > 0`
is met at

.. math::

    B^* = \frac{2 B_{noise}\,\tau\,N}{(1 - \tau)(N - 1 - B_{noise})}
    \;\xrightarrow{N \to \infty}\; \frac{2 B_{noise} \tau}{1 - \tau},

which is out of reach (infinite) once :math:`B_{noise} \ge N - 1`: then even the whole epoch's two halves
are expected to point apart.

Everything here is pure arithmetic on Python floats: the measurement modules reduce the gradients to
the five numbers of :class:`HalfStats`, and the controller works from those and the epoch's :math:`N`.
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
    def difference(self) -> float:
        """:math:`T = |g_A - g_B|^2 / (1/n_A + 1/n_B)`, whose mean is :math:`\\operatorname{tr}\\Sigma\\,N/(N-1)`."""
        diff_sq = max(self.sq_a + self.sq_b - 2.0 * self.dot, 0.0)  # >= 0 exactly; rounding can dip below
        return diff_sq / (1.0 / self.n_a + 1.0 / self.n_b)

    def estimates(self, population: float = math.inf) -> tuple[float, float]:
        """Unbiased estimates of :math:`(|G|^2, \\operatorname{tr}\\Sigma)` for halves drawn without replacement.

        Args:
            population: the :math:`N` samples the halves were drawn from (the epoch's; ``math.inf``: drawn
                with replacement, or from a stream). See the module docstring for the derivation.

        >>> HalfStats(dot=3.0, sq_a=5.0, sq_b=5.0, n_a=4, n_b=4).estimates(population=9)  # T = 8
        (3.888888888888889, 7.111111111111111)
        """
        if not population > 1:
            raise ValueError(f"`population` must exceed 1 sample, got {population}.")
        diff = self.difference
        if math.isinf(population):
            return self.dot, diff
        return self.dot + diff / population, diff * (population - 1.0) / population

    @property
    def grad_sq(self) -> float:
        """Estimate of :math:`|G|^2` for halves drawn with replacement, :math:`g_A \\cdot g_B` (it can be negative
        when the noise dominates); from a finite epoch use :meth:`estimates`."""
        return self.dot

    @property
    def trace_sigma(self) -> float:
        """Estimate of :math:`\\operatorname{tr}\\Sigma` for halves drawn with replacement, :math:`T`; from a finite
        epoch use :meth:`estimates`."""
        return self.difference

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


def expected_similarity(batch_size: float, noise_scale: float, population: float = math.inf) -> float:
    """Expected cosine similarity of two equal halves of a batch drawn without replacement from ``population``.

    The ratio of expectations of the module docstring; :math:`1 / (1 + 2 B_{noise} / B)` for an infinite
    population.

    >>> expected_similarity(batch_size=800, noise_scale=100)
    0.8
    >>> round(expected_similarity(batch_size=512, noise_scale=700, population=1437), 3)  # 0.268 if N were infinite
    0.158
    """
    if batch_size <= 0:
        raise ValueError(f"`batch_size` must be positive, got {batch_size}.")
    if not population > 1:
        raise ValueError(f"`population` must exceed 1 sample, got {population}.")
    if math.isinf(population):
        return 1.0 / (1.0 + 2.0 * noise_scale / batch_size)
    shared = 1.0 - noise_scale / (population - 1.0)
    return shared / (1.0 + 2.0 * noise_scale / batch_size * (population - batch_size / 2.0) / (population - 1.0))


def equilibrium_batch_size(noise_scale: float, target_similarity: float, population: float = math.inf) -> float:
    """The batch size :math:`B^*` at which two equal halves' expected similarity is ``tau``.

    :math:`2 B_{noise} \\tau N / ((1 - \\tau)(N - 1 - B_{noise}))`: for an infinite population
    :math:`2 B_{noise} \\tau / (1 - \\tau)`; ``math.inf`` for :math:`\\tau > 0` once :math:`B_{noise} \\ge N - 1`
    (no batch of that epoch reaches the target).

    >>> round(equilibrium_batch_size(noise_scale=100, target_similarity=0.8), 9)
    800.0
    >>> round(equilibrium_batch_size(noise_scale=100, target_similarity=0.3, population=1437), 1)  # 85.7 if infinite
    92.2
    """
    if not -1.0 < target_similarity < 1.0:
        raise ValueError(f"`target_similarity` must lie in (-1, 1), got {target_similarity}.")
    if not population > 1:
        raise ValueError(f"`population` must exceed 1 sample, got {population}.")
    infinite = 2.0 * noise_scale * target_similarity / (1.0 - target_similarity)
    if math.isinf(population):
        return infinite
    room = population - 1.0 - noise_scale
    if room <= 0:
        return math.inf if target_similarity > 0 else 0.0
    return infinite * population / room
