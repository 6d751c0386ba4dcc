"""Window plans: how one optimizer step's samples are cut into micro-batches on each rank.

An accumulation *window* is the run of micro-batches that one optimizer step averages. A plan fixes,
for a global window of ``n`` samples, the number of micro-batches ``k`` and the size of every
(micro-batch, rank) slot, so that:

- no slot holds more than ``max_micro_batch_size`` samples (the memory bound);
- slots are as equal as possible (differing by at most one sample), so the applied batch size is
  exactly ``n`` rather than ``k x micro x world`` rounded as in the paper's code;
- there are at least ``min_micro_batches`` micro-batches (two on one process, whose halves are
  measured against each other), an even number when that measurement needs it;
- no slot holds a single sample where the window has enough for two per slot: BatchNorm refuses a
  micro-batch of one, and plain Lightning with the same DataLoader feeds one only at an epoch tail of
  one. So the number of micro-batches never rises above what keeps two samples per slot, and an
  epoch's last few samples are not left as a window of their own when they are fewer than
  :func:`min_window` (too few to measure two halves with two samples a slot): the window before them
  takes them;
- an epoch's last two windows share what is left (:func:`tail_window`) where the last would otherwise
  hold fewer than half the batch asked for: no step is a sliver of the epoch's tail (on the digits
  recipe the last window fell from ~500 samples to ~20, a noisy step the controller then read), nor
  below half the step before it from the tail alone.

Pure Python: tested against hand-worked cases in ``tests/core/test_plan.py``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property

__all__ = ["Window", "min_window", "plan_window", "tail_window"]


@dataclass(frozen=True)
class Window:
    """One optimizer step's plan.

    Args:
        sizes: ``sizes[j][r]`` is the number of samples rank ``r`` feeds in micro-batch ``j``.
        weights: ``weights[j][r]`` is that slot's *weight*, what batch sizes count: its samples (None, the default:
            ``sizes``), or its tokens where batches are counted in tokens. Samples stay what an epoch's coverage and
            the ranks' shares count.
        order: where the window's samples are laid out slot by slot (micro-major, as :meth:`offset` counts), the
            position of each within the window's run of the epoch's order; None: in that order (a window planned
            in tokens groups samples of similar length, :mod:`~lightning_simigrad.core.token_plan`).

    >>> window = Window(((2, 2), (1, 1)))
    >>> window.total, window.weight, window.samples_per_rank()
    (6, 6, [3, 3])
    >>> Window(((2,), (1,)), weights=((70,), (40,))).weight
    110
    """

    sizes: tuple[tuple[int, ...], ...]
    weights: tuple[tuple[int, ...], ...] | None = None
    order: tuple[int, ...] | None = None

    @property
    def num_micro_batches(self) -> int:
        return len(self.sizes)

    @property
    def world_size(self) -> int:
        return len(self.sizes[0])

    @cached_property
    def samples_through(self) -> tuple[int, ...]:
        """``samples_through[j]``: samples of micro-batches ``0..j`` over all ranks (read every micro-batch)."""
        return tuple(itertools.accumulate(sum(micro) for micro in self.sizes))

    @property
    def total(self) -> int:
        """Samples averaged by the step, over all ranks."""
        return self.samples_through[-1]

    @property
    def max_micro_batch_size(self) -> int:
        return max(max(micro) for micro in self.sizes)

    @cached_property
    def weight_through(self) -> tuple[int, ...]:
        """``weight_through[j]``: the weight of micro-batches ``0..j`` over all ranks."""
        slots = self.sizes if self.weights is None else self.weights
        return tuple(itertools.accumulate(sum(micro) for micro in slots))

    @property
    def weight(self) -> int:
        """The step's weight over all ranks: what the controller's batch size, the LR factor and the counts read."""
        return self.weight_through[-1]

    def micro_weight(self, micro: int) -> int:
        """The weight of micro-batch ``micro`` over all ranks."""
        return self.weight_through[micro] - (self.weight_through[micro - 1] if micro else 0)

    def rank_total(self, rank: int) -> int:
        return sum(micro[rank] for micro in self.sizes)

    def samples_per_rank(self) -> list[int]:
        return [self.rank_total(r) for r in range(self.world_size)]

    def offset(self, micro: int, rank: int) -> int:
        """Position of slot ``(micro, rank)`` within the window's samples (slots laid out micro-major)."""
        before = self.samples_through[micro - 1] if micro else 0
        return before + sum(self.sizes[micro][:rank])

    def slot_positions(self, micro: int, rank: int) -> range | tuple[int, ...]:
        """The positions, within the window's run of the epoch's order, of slot ``(micro, rank)``'s samples.

        >>> Window(((1, 1), (1, 1)), order=(3, 0, 2, 1)).slot_positions(1, 0)
        (2,)
        """
        first = self.offset(micro, rank)
        end = first + self.sizes[micro][rank]
        return range(first, end) if self.order is None else self.order[first:end]

    def half_split(self) -> int:
        """Micro-batches in the first half of the window (one process measures the halves in time)."""
        return self.num_micro_batches // 2


def _split(total: int, parts: int) -> list[int]:
    """``total`` into ``parts`` integers differing by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def min_window(world_size: int, min_micro_batches: int = 1) -> int:
    """The fewest samples a window needs to give every slot two samples: ``2 W m``.

    >>> min_window(world_size=1, min_micro_batches=2), min_window(world_size=4)
    (4, 8)
    """
    return 2 * world_size * min_micro_batches


def tail_window(batch_size: int, available: int, previous: int = 0) -> int:
    """The samples the next window asks for, with ``available`` left in the epoch: ``batch_size``, unless the window
    after it, the epoch's last, would then hold fewer than ``batch_size / 2``; then the two share what is left, the
    first taking the larger half. Every sample is still fed once: the next window takes the rest.

    Where the controller has just shrunk the batch, the two shares could fall below half of the ``previous``
    window (the one planned before them); the window then takes all that is left instead (fewer than
    ``1.5 batch_size`` samples), so that no step is below half the step before it from the tail alone.

    >>> tail_window(500, 10_000), tail_window(500, 520)  # 20 would be left: 260 and 260
    (500, 260)
    >>> tail_window(500, 800), tail_window(500, 500)  # 300 >= 250 left; no tail at all
    (500, 500)
    >>> tail_window(460, 520, previous=560)  # shares of 260 < 280: one window of 520
    520
    """
    left = available - batch_size
    if left > 0 and 2 * left < batch_size:
        shares = available - available // 2
        return shares if 2 * (available // 2) >= previous else available
    return batch_size


def plan_window(
    batch_size: int,
    available: int,
    world_size: int,
    max_micro_batch_size: int,
    min_micro_batches: int = 1,
    even_micro_batches: bool = False,
    take_small_remainder: bool = True,
) -> Window:
    """Plan a window of ``min(batch_size, available)`` samples (all of ``available`` if the rest would be tiny).

    Args:
        batch_size: the global batch size the controller asks for.
        available: samples left in the epoch (the window is cut to them: the epoch's tail).
        world_size: ranks sharing the window.
        max_micro_batch_size: per-rank cap of a micro-batch.
        min_micro_batches: fewest micro-batches (2 where the halves are two halves in time).
        even_micro_batches: round the count up to even, so the two halves in time are equal.
        take_small_remainder: take the rest of ``available`` too when fewer than :func:`min_window`
            samples would remain (False where that rest is a tail ``drop_last`` drops).

    A window that would leave fewer than :func:`min_window` samples behind takes them too (it is the
    epoch's last), so no step is a sliver. The memory cap always holds; below it, slots keep at least
    two samples where the window has them, even if that means fewer micro-batches than
    ``min_micro_batches`` (a window of 3 samples on one process is one unmeasured micro-batch of 3).
    A slot may be 0 only when the window has fewer samples than ranks (a tiny epoch); the sampler then
    feeds such a rank one sample with zero weight so that every rank still steps.

    >>> plan_window(100, 10_000, world_size=1, max_micro_batch_size=64, min_micro_batches=2).sizes
    ((50,), (50,))
    >>> plan_window(301, 10_000, world_size=2, max_micro_batch_size=64).sizes
    ((51, 50), (50, 50), (50, 50))
    >>> plan_window(500, 7, world_size=2, max_micro_batch_size=64).sizes  # the epoch's last 7 samples
    ((4, 3),)
    >>> plan_window(16, 19, world_size=1, max_micro_batch_size=8, min_micro_batches=2).sizes  # 3 left: taken
    ((7,), (6,), (6,))
    """
    if available <= 0 or batch_size <= 0:
        raise ValueError(f"a window needs at least one sample, got batch_size={batch_size}, available={available}")
    n = min(batch_size, available)
    if take_small_remainder and available - n < min_window(world_size, min_micro_batches):
        n = available
    fewest = math.ceil(n / (world_size * max_micro_batch_size))  # the memory cap's minimum
    k = max(min_micro_batches, fewest)
    if even_micro_batches and k % 2:
        k += 1
    # two samples per slot where the window has them (one, if the user's cap is one)
    k = min(k, max(1, n // (world_size * min(2, max_micro_batch_size))))
    k = max(k, fewest)
    # every rank needs a sample in every micro-batch where the window allows it
    k = max(1, min(k, n // world_size))
    per_micro = _split(n, k)
    return Window(tuple(tuple(_split(m, world_size)) for m in per_micro))
