r"""How a step weighs its losses: every sample of the step alike, or every loss item alike.

``training_step`` returns the mean loss of its micro-batch: over its samples (the default of every torch loss), or,
for a language model, over its labelled tokens (``ignore_index=-100`` on padding and prompts), whose number varies
from micro-batch to micro-batch. A step's gradient must be the mean over what the step averages, whatever the
micro-batches hold. A :class:`Weighing` says, for each micro-batch, the weight its loss stands for (the
denominator of its loss divisor :math:`N / (W w)`, :math:`N` the window's samples), and, before the optimizer
steps, makes the window's gradient that mean and the halves' statistics the halves' means. The unit
(:mod:`~lightning_simigrad.core.units`) picks it: :func:`weighing_for`.

- :class:`SampleMeans`: every sample of a step weighs :math:`1/N`; where micro-batches were skipped (their
  ``training_step`` returned None), over the samples fed.
- :class:`ItemMeans` (``SimiGrad(loss_items=fn)``): ``fn(batch)`` counts a micro-batch's items and every item of the
  step weighs exactly :math:`1/T`, :math:`T` the step's items on all ranks. A micro-batch's
  items are known only once it is collated (BERT's masking, for one, happens in the collate function), so the
  division is deferred, as Megatron's per-token loss and torchtune do it: a micro-batch of :math:`t` items is
  weighed by :math:`t` in place of its samples (loss divisor :math:`N / (W t)`), so the window's gradient
  accumulates :math:`S / N`, :math:`S` the sum of the step's item-loss gradients; before the optimizer steps it is
  multiplied by :math:`N / T`: one fused multiply. Each rank's items in the measurement's half A and half B cross
  ranks as two columns of the step's rows (:class:`~lightning_simigrad.measurement.protocol.Columns`), in the one
  exchange a step makes. The halves are item means too: :math:`g_A = S_A / T_A`, :math:`g_B = S_B / T_B`, the
  halves free to hold unequal items. What batch sizes count stays the unit's (samples, or tokens), so the
  statistics keep the halves' sample counts: the noise scale they give counts *samples* of the item-weighted
  gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import Tensor

from lightning_simigrad import _compat
from lightning_simigrad.core.statistics import HalfStats
from lightning_simigrad.exchange import processes
from lightning_simigrad.measurement.protocol import Columns

__all__ = ["Gradients", "ItemMeans", "SampleMeans", "Weighing", "count_items", "in_items", "weighing_for"]

Gradients = Callable[[], Sequence[Tensor]]  # the tensors that hold the step's gradient, read only when needed


def count_items(loss_items: Callable[[Any], Any], batch: Any) -> int:
    """The number of loss items ``loss_items(batch)`` says the micro-batch holds, checked.

    >>> import torch
    >>> count_items(lambda b: torch.tensor([[1, -100], [3, 4]]).ne(-100).sum(), None)
    3
    >>> count_items(lambda b: -1, None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: `loss_items` must return ... a non-negative integer; it returned -1. ...
    """
    value = loss_items(batch)
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()  # the loss itself needs the labels on the host side of any sync anyway
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            "`loss_items` must return the micro-batch's number of loss items, a non-negative integer; it returned"
            f" {value!r}. Count the items the loss averages over, e.g. `lambda batch: (batch['labels'] != -100)"
            ".sum()`."
        )
    return value


def in_items(stats: HalfStats, items_a: int, items_b: int) -> HalfStats:
    """The statistics of item-mean halves from those of the halves' sample means of the same item sums.

    The measurement returns :math:`g_A = S_A / n_A` (each half's gradient divided by its samples); the item mean is
    :math:`S_A / T_A`. The sample counts stay: the batch is stated in samples.

    >>> in_items(HalfStats(dot=2.0, sq_a=4.0, sq_b=4.0, n_a=2, n_b=2), items_a=4, items_b=8)
    HalfStats(dot=0.25, sq_a=1.0, sq_b=0.25, n_a=2, n_b=2)
    """
    if items_a <= 0 or items_b <= 0:  # a half without items has no mean: nothing to compare
        nan = math.nan
        return HalfStats(dot=nan, sq_a=nan, sq_b=nan, n_a=stats.n_a, n_b=stats.n_b)
    fa, fb = stats.n_a / items_a, stats.n_b / items_b
    return HalfStats(stats.dot * fa * fb, stats.sq_a * fa * fa, stats.sq_b * fb * fb, stats.n_a, stats.n_b)


class Weighing(Protocol):
    """How a step weighs its micro-batches' losses (see the module docstring)."""

    def start(self, batch: Any, index: int, local_samples: int) -> int:
        """Micro-batch ``index`` of a window starts on this rank: the weight its mean loss stands for."""

    def after_backward(self, half: int) -> None:
        """The micro-batch's backward ran; it fed the measurement's half ``half`` (0: A, 1: B)."""

    def columns(self) -> Columns | None:
        """What the step's rows must carry for :meth:`finish` (None: nothing)."""

    def finish(
        self, grads: Gradients, window_total: int, fed: int, stats: HalfStats | None, columns: Columns | None
    ) -> HalfStats | None:
        """Before the optimizer steps: the gradient made the step's mean and the halves' statistics the halves'
        means; ``grads()`` gives the tensors that hold the gradient the optimizer steps with, ``fed`` is the window's
        samples whose backward ran, ``columns`` what :meth:`columns` asked for, with its totals over the ranks."""


class SampleMeans:
    """Every sample of a step weighs alike: a micro-batch's mean loss stands for its samples."""

    def start(self, batch: Any, index: int, local_samples: int) -> int:
        return local_samples

    def after_backward(self, half: int) -> None:
        pass

    def columns(self) -> Columns | None:
        return None

    def finish(
        self, grads: Gradients, window_total: int, fed: int, stats: HalfStats | None, columns: Columns | None
    ) -> HalfStats | None:
        if 0 < fed < window_total:  # micro-batches were skipped (`training_step` returned None): a mean over the fed
            _compat.foreach_mul_(list(grads()), window_total / fed)
        return stats


class ItemMeans:
    """Every loss item of a step weighs alike: each micro-batch's items, each half's, and the step's on all
    data-parallel ranks.

    Args:
        count: the user's ``loss_items``.
        world_size: the data-parallel ranks (the processes beyond them, tensor-parallel ranks, feed the same
            batches and are counted once).
    """

    def __init__(self, count: Callable[[Any], Any], world_size: int) -> None:
        self.count, self.world_size = count, world_size
        self.local = 0  # the running micro-batch's items on this rank
        self.fed = [0, 0]  # this rank's items whose backward ran in this window, by the measurement's half

    def start(self, batch: Any, index: int, local_samples: int) -> int:
        if index == 0:
            self.fed = [0, 0]
        self.local = count_items(self.count, batch) if local_samples else 0  # 0: a zero-weight padding sample
        return self.local

    def after_backward(self, half: int) -> None:
        self.fed[half] += self.local

    def columns(self) -> Columns | None:
        return Columns((float(self.fed[0]), float(self.fed[1])))  # this rank's items in each half

    def finish(
        self, grads: Gradients, window_total: int, fed: int, stats: HalfStats | None, columns: Columns | None
    ) -> HalfStats | None:
        assert columns is not None and columns.totals is not None
        replicas = processes() // self.world_size  # tensor-parallel processes count their rank's items
        items_a, items_b = (round(total / replicas) for total in columns.totals)
        if items_a + items_b > 0:  # a step without items leaves its (zero) gradient as it is
            _compat.foreach_mul_(list(grads()), window_total / (items_a + items_b))
        return in_items(stats, items_a, items_b) if stats is not None else None


def weighing_for(loss_items: Callable[[Any], Any] | None, world_size: int) -> Weighing:
    """Every loss item alike where ``loss_items`` counts them, else every sample alike."""
    return SampleMeans() if loss_items is None else ItemMeans(loss_items, world_size)
