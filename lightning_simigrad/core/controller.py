"""The batch-size controller: from one step's half-batch statistics to the next step's batch size.

Pure Python, no Lightning: :class:`BatchSizeController` takes a :class:`~lightning_simigrad.HalfStats`
per optimizer step and returns the batch size to use next. Three rules:

- ``"paper"`` (SimiGrad's): similarity below the target grows the batch by ``grow_factor`` (1.1),
  above it shrinks the batch by ``shrink_factor`` (0.9);
- ``"noise_scale"``: move straight to :math:`B^* = 2 B_{noise} \\tau / (1 - \\tau)`, with the noise
  scale :math:`B_{noise} = \\operatorname{tr}\\Sigma / |G|^2` smoothed as McCandlish et al. advise
  (an EMA of numerator and denominator separately, divided afterwards);
- ``"ratchet"``: a ramp the data chooses. The batch grows towards :math:`B^*`, by at most ``grow_factor`` a
  step, and never shrinks. Tuned ramps beat both rules above on steadiness (docs/evidence.md): a batch that
  moves 10% every step on a noisy similarity, or jumps with a noisy :math:`B^*`, costs loss that a steady
  batch of the same mean does not; and the critical batch grows as the loss falls, so a batch that only grows
  loses little by not shrinking.

The noise scale's numerator and denominator are each step's unbiased finite-population estimates
(:meth:`HalfStats.estimates <lightning_simigrad.core.statistics.HalfStats.estimates>` with the epoch's
:math:`N`, passed to :meth:`BatchSizeController.update`), and the rule aims at :math:`B^*` in its
finite-population form. Both are averaged in units of the *previous* step's mean squared half gradient
:math:`m = (|g_A|^2 + |g_B|^2) / 2`:

- Training shrinks :math:`|G|^2` and :math:`\\operatorname{tr}\\Sigma` by orders of magnitude (on the digits
  recipe :math:`|G|^2` fell ~10^5-fold within 100 steps); an EMA of the raw values is then ruled by the large
  values of steps long gone, whatever its decay (it reported 125 where the last steps said ~2,000). In units of
  a recent :math:`m` every step weighs alike and the past fades at the decay's rate.
- The unit must not be the step's *own* :math:`m` (the former smoothing): :math:`m` is made of the same noisy
  half gradients, so each step is weighed by its own noise and the ratio of the averages is biased, by an amount
  that depends on B and does not vanish however long the memory: -9% to +26% on the digits models at frozen
  weights (``benchmarks/noise_scale_reference.py --variants`` shows it beside the others, column ``own``).
  The previous step's :math:`m` comes from other samples, so at fixed weights the weights it gives are
  independent of the step's estimates, and the ratio of the two averages converges to
  :math:`\\operatorname{tr}\\Sigma / |G|^2` as the memory grows, for every B.
- A smoothed reference (an EMA of :math:`m`) would lag a shrinking gradient as the raw EMA does. A decay
  counted in samples was not adopted: it lengthens the memory in steps exactly where B is below the noise
  scale, which is where training needs it to follow a change quickly (``tests/core/test_controller.py``'s
  shrinking gradient is such a case).

What remains is the ratio of two finite averages: where a step's :math:`|G|^2` estimate is mostly noise
(B well below :math:`B_{noise}`, the noise spread over few directions) the logged value scatters and its
mean runs high; a larger ``noise_scale_decay`` is the remedy, at the cost of following training more slowly.

The noise-scale rule acts on :math:`B^*` only once the averaged :math:`|G|^2` stands ``RESOLVED_Z`` standard errors
above zero (:attr:`BatchSizeController.noise_scale_resolved`); before that its ratio can read anything up to
:math:`N` and beyond, where :math:`B^*` diverges, and a jump there (with the LR scaled to match) threw digits runs
off course (docs/measurement.md). Meanwhile it steps as the paper rule does.

The halves' statistics count samples (sequences, with ``loss_items`` too), so :math:`B_{noise}` and :math:`B^*`
do. Where the batch counts tokens (``counts_tokens``), :math:`B^*` is carried into tokens by the step's own tokens
per sample: the batch the controller asked for over the samples the halves hold.

All clamp to ``[min_batch_size, max_batch_size]``, hold still during ``warmup_steps`` and inside a
``deadband`` around the target, and ignore non-finite measurements (a mixed-precision overflow).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from lightning_simigrad.core.fields import EMA, NON_NEGATIVE_INT, NON_NEGATIVE_NUMBER, POSITIVE_NUMBER, Field
from lightning_simigrad.core.statistics import HalfStats, equilibrium_batch_size

__all__ = ["BatchSizeController", "RULES"]

RULES = ("paper", "noise_scale", "ratchet")
RESOLVED_Z = 3.0  # standard errors the averaged |G|^2 must stand above 0 before the noise-scale rule acts on it


class _Ema:
    """Exponential moving average with bias correction, so the first value is not pulled towards 0."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.biased = 0.0
        self.weight = 0.0

    def update(self, value: float) -> None:
        self.biased = self.decay * self.biased + (1.0 - self.decay) * value
        self.weight = self.decay * self.weight + (1.0 - self.decay)

    @property
    def value(self) -> float:
        return self.biased / self.weight if self.weight > 0 else math.nan

    @property
    def effective_count(self) -> float:
        """How many equally weighted values the average is worth: ``(sum w)^2 / sum w^2`` over its weights
        ``w_i = (1 - d) d^(t - i)``, from the total weight ``W = 1 - d^t`` alone; 1 after one value."""
        d, w = self.decay, self.weight
        return (1.0 + d) * w / ((1.0 - d) * (2.0 - w)) if w > 0 else 0.0


class BatchSizeController:
    """Chooses the next global batch size from the similarity of two half-batch gradients.

    Args:
        target_similarity: the cosine similarity to hold, in (-1, 1).
        initial_batch_size: the starting global batch size ``B0``.
        min_batch_size: lower bound (default ``1``).
        max_batch_size: upper bound (default unbounded).
        rule: ``"paper"``, ``"noise_scale"`` or ``"ratchet"`` (see the module docstring).
        grow_factor: the paper rule's factor below the target (> 1); the ratchet's largest growth a step.
        shrink_factor: the paper rule's factor above the target (in (0, 1)).
        smoothing: EMA decay in [0, 1) of the similarity the paper rule compares (0: the raw value).
        noise_scale_decay: EMA decay in [0, 1) of the noise-scale numerator and denominator.
        deadband: no change while ``|similarity - target| <= deadband``.
        warmup_steps: measured steps to wait before the first change.
        counts_tokens: the batch counts tokens, the halves samples: :math:`B^*` is carried into tokens.

    Raises:
        ValueError: for any argument out of range; the message names it and says the fix.

    Example::

        >>> c = BatchSizeController(target_similarity=0.8, initial_batch_size=100)
        >>> c.update(HalfStats(dot=0.5, sq_a=1.0, sq_b=1.0, n_a=50, n_b=50))  # 0.5 < 0.8: grow
        110
        >>> c.update(HalfStats(dot=0.9, sq_a=1.0, sq_b=1.0, n_a=55, n_b=55))  # 0.9 > 0.8: shrink
        99
    """

    def __init__(
        self,
        target_similarity: float | None,
        initial_batch_size: int,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        rule: str = "paper",
        grow_factor: float = 1.1,
        shrink_factor: float = 0.9,
        smoothing: float = 0.0,
        noise_scale_decay: float = 0.9,
        deadband: float = 0.0,
        warmup_steps: int = 0,
        counts_tokens: bool = False,
    ) -> None:
        _check_arguments(  # refused at construction, each naming its argument
            target_similarity,
            initial_batch_size,
            min_batch_size,
            max_batch_size,
            rule,
            grow_factor,
            shrink_factor,
            smoothing,
            noise_scale_decay,
            deadband,
            warmup_steps,
        )

        self.target_similarity = target_similarity
        self.min_batch_size = min_batch_size or 1
        self.max_batch_size = max_batch_size
        self.rule = rule
        self.grow_factor = grow_factor
        self.shrink_factor = shrink_factor
        self.deadband = deadband
        self.warmup_steps = warmup_steps
        self.counts_tokens = counts_tokens
        # The controller keeps a real-valued size: rounding only on the way out, so that repeated
        # x1.1 / x0.9 at small sizes are not swallowed by rounding (the paper's code loses them).
        self._size = float(self._clamp(initial_batch_size))
        self._similarity = _Ema(smoothing)
        # |G|^2 and tr(Sigma), each step's in units of the step before's mean |g_half|^2 (see the module docstring)
        self._grad_sq = _Ema(noise_scale_decay)
        self._grad_sq_square = _Ema(noise_scale_decay)  # of the squares, for the spread of the |G|^2 estimates
        self._trace_sigma = _Ema(noise_scale_decay)
        self._reference = 0.0  # the last measured step's mean |g_half|^2 (0: none yet)
        self.population = math.inf  # the N of the last measured step's epoch
        self.measured_steps = 0

    # ----------------------------------------------------------------------------------- the rule
    def update(self, stats: HalfStats, adjust: bool = True, population: float = math.inf) -> int:
        """Feed one step's statistics; returns the batch size for the next step.

        Args:
            stats: the step's two halves.
            adjust: with False the smoothed similarity and noise scale follow the measurement but the
                batch size stays where it is.
            population: the samples :math:`N` the halves were drawn from without replacement (the epoch's;
                ``math.inf`` for draws with replacement): the noise scale is estimated, and :math:`B^*`
                aimed at, in the finite-population form (:mod:`~lightning_simigrad.core.statistics`).
        """
        if adjust and self.target_similarity is None:  # refused before any average takes the step in
            raise ValueError(
                "This controller was built without `target_similarity`, so it measures only: call"
                " `update(stats, adjust=False)`, or build it with a target in (-1, 1)."
            )
        if not stats.is_finite:
            return self.batch_size  # an overflowed or empty measurement says nothing: hold
        self.measured_steps += 1
        self.population = population
        self._similarity.update(stats.similarity)
        size = 0.5 * (stats.sq_a + stats.sq_b)  # > 0 for a finite measurement
        # the previous step's size: independent of this step's samples (see the module docstring)
        reference = self._reference if self._reference > 0 else size
        self._reference = size
        grad_sq, trace_sigma = stats.estimates(population)
        self._grad_sq.update(grad_sq / reference)
        self._grad_sq_square.update((grad_sq / reference) ** 2)
        self._trace_sigma.update(trace_sigma / reference)
        if not adjust or self.measured_steps <= self.warmup_steps:
            return self.batch_size
        target = self.target_similarity
        assert target is not None  # adjusting without one was refused above
        if abs(self.similarity - target) <= self.deadband:
            return self.batch_size
        below = self.similarity < target
        if self.rule == "paper" or not self.noise_scale_resolved:
            # The noise-scale rules before |G|^2 is told from its noise: B_noise, and B* above all near N, could be
            # anything; a jump to it (with the LR scaled to match) threw digits runs off course. They step as the
            # paper rule does instead, the ratchet without shrinking.
            factor = self.grow_factor if below else self.shrink_factor if self.rule != "ratchet" else 1.0
            self._size = self._clamp(self._size * factor)
            return self.batch_size
        b_star = self._b_star(stats, target)
        if self.rule == "noise_scale":
            if math.isfinite(b_star) and b_star > 0:
                self._size = self._clamp(b_star)
            elif below or math.isinf(b_star):
                # |G|^2 estimate <= 0 or B_noise beyond the epoch: the gradient is all noise at this size, so B*
                # is beyond reach
                self._size = self._clamp(self._size * self.grow_factor)
        else:  # ratchet: towards B*, at most grow_factor a step, never down
            growth = b_star / self._size if b_star > 0 else 1.0
            self._size = self._clamp(self._size * min(max(growth, 1.0), self.grow_factor))
        return self.batch_size

    def _b_star(self, stats: HalfStats, target: float) -> float:
        """:math:`B^*` for the smoothed noise scale, in the batch's unit (NaN while the estimate is not positive,
        ``math.inf`` where no batch of the epoch reaches the target)."""
        noise_scale = self.noise_scale
        if not (math.isfinite(noise_scale) and noise_scale > 0):
            return math.nan
        b_star = equilibrium_batch_size(noise_scale, target, self.population)
        if self.counts_tokens:
            # B* counts samples; the step asked for self._size tokens and its halves hold n_a + n_b samples
            b_star *= self._size / (stats.n_a + stats.n_b)
        return b_star

    def _clamp(self, size: float) -> float:
        size = max(size, float(self.min_batch_size))
        if self.max_batch_size is not None:
            size = min(size, float(self.max_batch_size))
        return size

    # ----------------------------------------------------------------------------------- readings
    @property
    def batch_size(self) -> int:
        """The batch size the controller asks for (an int >= 1)."""
        return max(1, round(self._size))

    @property
    def similarity(self) -> float:
        """The (smoothed) similarity the rule last compared, NaN before the first measurement."""
        return self._similarity.value

    @property
    def noise_scale(self) -> float:
        """Smoothed simple noise scale :math:`B_{noise}`; NaN before any measurement or while |G|^2 <= 0."""
        grad_sq = self._grad_sq.value
        return self._trace_sigma.value / grad_sq if grad_sq > 0 else math.nan

    @property
    def noise_scale_resolved(self) -> bool:
        """Whether the averaged :math:`|G|^2` estimate stands ``RESOLVED_Z`` standard errors above 0 (its spread over
        the averaged steps, taken as independent), so the noise scale is worth acting on; always with no memory
        (``noise_scale_decay=0``), where a single step gives no spread to judge by."""
        ema = self._grad_sq
        if ema.decay == 0.0:
            return ema.value > 0
        # the squares' average may be younger (a checkpoint written before it was kept): count what both have seen
        count, mean = min(ema.effective_count, self._grad_sq_square.effective_count), ema.value
        if not count > 1.0 + 1e-9 or not mean > 0:
            return False
        spread = max(self._grad_sq_square.value - mean * mean, 0.0) * count / (count - 1.0)  # unbiased
        return mean > RESOLVED_Z * math.sqrt(spread / count)

    # ----------------------------------------------------------------------------------- state
    STATE_FIELDS: ClassVar[dict[str, Field]] = {
        "size": POSITIVE_NUMBER,
        "measured_steps": NON_NEGATIVE_INT,
        "similarity_ema": EMA,
        "referenced_grad_sq_ema": EMA,
        "referenced_trace_sigma_ema": EMA,
        "reference": NON_NEGATIVE_NUMBER,
        "referenced_grad_sq_square_ema": EMA,
    }
    # what earlier writers saved instead of the noise scale's averages (checked, then not read): the averages in units
    # of each step's own gradient size, and before them the raw averages
    FORMER_NOISE_FIELDS: ClassVar[tuple[tuple[str, ...], ...]] = (
        ("relative_grad_sq_ema", "relative_trace_sigma_ema"),
        ("grad_sq_ema", "trace_sigma_ema"),
    )

    @classmethod
    def state_fields(cls, state: dict[str, Any]) -> dict[str, Field]:
        """The fields ``state`` must have: this version's, or an earlier writer's noise-scale averages instead."""
        noise = ("referenced_grad_sq_ema", "referenced_trace_sigma_ema", "reference", "referenced_grad_sq_square_ema")
        if any(name in state for name in noise):
            if "referenced_grad_sq_square_ema" not in state:  # written before the spread was kept: it starts afresh
                return {name: field for name, field in cls.STATE_FIELDS.items() if name != noise[-1]}
            return dict(cls.STATE_FIELDS)
        for former in cls.FORMER_NOISE_FIELDS:
            if any(name in state for name in former):
                fields = {name: field for name, field in cls.STATE_FIELDS.items() if name not in noise}
                return {**fields, **{name: EMA for name in former}}
        return dict(cls.STATE_FIELDS)

    def state_dict(self) -> dict[str, Any]:
        return {
            "size": self._size,
            "measured_steps": self.measured_steps,
            "similarity_ema": [self._similarity.biased, self._similarity.weight],
            # in units of the step before's |g_half|^2, finite-population estimates; older checkpoints' averages
            # (raw, or in units of each step's own |g_half|^2, with-replacement estimates) are not read back
            "referenced_grad_sq_ema": [self._grad_sq.biased, self._grad_sq.weight],
            "referenced_trace_sigma_ema": [self._trace_sigma.biased, self._trace_sigma.weight],
            "reference": self._reference,
            "referenced_grad_sq_square_ema": [self._grad_sq_square.biased, self._grad_sq_square.weight],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._size = self._clamp(float(state.get("size", self._size)))
        self.measured_steps = int(state.get("measured_steps", 0))
        for key, ema in (
            ("similarity_ema", self._similarity),
            ("referenced_grad_sq_ema", self._grad_sq),
            ("referenced_trace_sigma_ema", self._trace_sigma),
            ("referenced_grad_sq_square_ema", self._grad_sq_square),
        ):
            if key in state:
                ema.biased, ema.weight = (float(v) for v in state[key])
        self._reference = float(state.get("reference", 0.0))


def _check_arguments(
    target_similarity: float | None,
    initial_batch_size: int,
    min_batch_size: int | None,
    max_batch_size: int | None,
    rule: str,
    grow_factor: float,
    shrink_factor: float,
    smoothing: float,
    noise_scale_decay: float,
    deadband: float,
    warmup_steps: int,
) -> None:
    """:class:`BatchSizeController`'s arguments, each refused with its name, its value and the fix."""
    if target_similarity is not None:  # None: a controller that measures and never moves the batch
        validate_target_similarity(target_similarity)
    for name, value in (("initial_batch_size", initial_batch_size),):
        _require_positive_int(name, value)
    if min_batch_size is not None:
        _require_positive_int("min_batch_size", min_batch_size)
    if max_batch_size is not None:
        _require_positive_int("max_batch_size", max_batch_size)
    if min_batch_size is not None and max_batch_size is not None and min_batch_size > max_batch_size:
        raise ValueError(
            f"`min_batch_size` ({min_batch_size}) must not exceed `max_batch_size` ({max_batch_size})."
            " Swap them or widen the range."
        )
    if rule not in RULES:
        raise ValueError(f"`controller` must be one of {RULES}, got {rule!r}.")
    if not grow_factor > 1.0:
        raise ValueError(f"`grow_factor` must be > 1, got {grow_factor}. The paper uses 1.1.")
    if not 0.0 < shrink_factor < 1.0:
        raise ValueError(f"`shrink_factor` must lie in (0, 1), got {shrink_factor}. The paper uses 0.9.")
    for name, decay in (("smoothing", smoothing), ("noise_scale_decay", noise_scale_decay)):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"`{name}` is an EMA decay and must lie in [0, 1), got {decay}. Use 0 for none.")
    if not deadband >= 0.0:
        raise ValueError(f"`deadband` must be >= 0, got {deadband}.")
    if not (isinstance(warmup_steps, int) and warmup_steps >= 0):
        raise ValueError(f"`warmup_steps` must be a non-negative int, got {warmup_steps!r}.")


def validate_target_similarity(value: float) -> None:
    if not (isinstance(value, (int, float)) and -1.0 < value < 1.0):
        raise ValueError(
            f"`target_similarity` must lie in (-1, 1), got {value!r}. The paper uses 0.8 for BERT and 0.2 for"
            " ResNet-18 on CIFAR-10."
        )


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
