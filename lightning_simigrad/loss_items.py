r"""Steps weighed by loss items (labelled tokens): every item of a step weighs exactly ``1 / T``.

A language model's ``training_step`` returns the mean loss over its micro-batch's labelled tokens (PyTorch's
default reduction, ``ignore_index=-100`` on padding and prompts), and their number varies from micro-batch to
micro-batch. Weighing each micro-batch by its *samples* then makes a step's gradient a mean of per-micro-batch
means, not the mean over the step's tokens. With ``SimiGrad(loss_items=fn)``, ``fn(batch)`` counts a micro-batch's
items and every item of the step weighs exactly :math:`1/T`, :math:`T` the step's items on all ranks.

The items of a window are known only once its last micro-batch is collated (BERT's masking, for one, happens in
the collate function), so the division is deferred, as Megatron's per-token loss and torchtune do it: a
micro-batch of :math:`t` items is weighed by :math:`t` in place of its samples (loss divisor
:math:`N / (W t)` in place of :math:`N / (W n)`, :math:`N` the window's samples), so the window's gradient
accumulates :math:`S / N`, :math:`S` the sum of the step's item-loss gradients; before the optimizer steps it is
multiplied by :math:`N / T`: one fused multiply, after one all-reduce of two numbers per step across the
data-parallel ranks (each rank's items in the measurement's half A and half B).

The halves are item means too: :math:`g_A = S_A / T_A`, :math:`g_B = S_B / T_B`, their similarity theirs, the
halves free to hold unequal items. The batch still counts samples (the controller, the LR factor, the budget),
so the statistics keep the halves' sample counts: the noise scale they give counts *samples* of the
item-weighted gradient, the unit the batch is stated in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_simigrad import _compat
from lightning_simigrad.core.statistics import HalfStats

__all__ = ["LossItems", "count_items", "in_items"]


def count_items(loss_items: Callable[[Any], Any], batch: Any) -> int:
    """The number of loss items ``loss_items(batch)`` says the micro-batch holds, checked.

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


class LossItems:
    """One fit's count of loss items: each micro-batch's, each half's, and the step's on all data-parallel ranks.

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
        """Micro-batch ``index`` of a window starts: its items (0 for a zero-weight padding sample)."""
        if index == 0:
            self.fed = [0, 0]
        self.local = count_items(self.count, batch) if local_samples else 0
        return self.local

    def after_backward(self, half: int) -> None:
        self.fed[half] += self.local

    def finish(self, params: Sequence[Tensor], window_total: int, stats: HalfStats | None) -> HalfStats | None:
        """Before the optimizer steps: the gradient made the mean over the step's items, the halves' statistics
        item means. A step without items leaves its (zero) gradient as it is."""
        items_a, items_b = self._global()
        grads = [p.grad for p in params if p.grad is not None]
        if items_a + items_b > 0:
            _compat.foreach_mul_(grads, window_total / (items_a + items_b))
        return in_items(stats, items_a, items_b) if stats is not None else None

    def _global(self) -> tuple[int, int]:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.fed[0], self.fed[1]
        backend = str(dist.get_backend()).lower()
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        counts = torch.tensor(self.fed, dtype=torch.float64, device=device)
        dist.all_reduce(counts)
        replicas = dist.get_world_size() // self.world_size  # tensor-parallel processes count their rank's items
        items_a, items_b = (round(float(c) / replicas) for c in counts.tolist())
        return items_a, items_b
