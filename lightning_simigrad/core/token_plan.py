"""Windows planned in tokens: which of a window's sequences go together into a micro-batch, on which rank.

Where batches are counted in tokens (``SimiGrad(lengths=...)``), the data path decides first *which* samples a window
holds (consecutive samples of the epoch's order, until their tokens reach the batch asked for) and then, here, how
they are cut into ``k`` micro-batches on each of ``W`` ranks so that:

- every slot's *padded* tokens -- its samples times its longest sample -- stay within ``max_micro_batch_tokens``
  (the memory bound, whatever the lengths), and its samples within ``max_micro_batch_size``;
- samples of similar length share a slot (the window's samples are sorted by length and cut into runs), which cuts
  padding as a length-grouped sampler does without changing which samples the window holds;
- every rank runs the same number of micro-batches (a window is a ``k x W`` grid), as FSDP's collectives need;
- the two halves of the window see alike lengths: the runs, longest first, are dealt alternately to the first and
  the second half of the micro-batches (the halves in time of one process; which half takes the longer run of a pair
  alternates) and, within a micro-batch, to the ranks
  in a snake order (the rank groups of DDP). Sorted halves -- the short sequences in one half, the long in the
  other -- would make the two halves' gradients differ for a reason that is not noise, and bias the similarity low.

The window's :attr:`~lightning_simigrad.core.plan.Window.order` lays its samples out slot by slot.

Pure Python: tested against hand-worked cases in ``tests/core/test_token_plan.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_simigrad.core.plan import Window

__all__ = ["padded_tokens", "plan_token_window"]


def padded_tokens(lengths: Sequence[int]) -> int:
    """Tokens of a micro-batch of these lengths after padding to its longest: ``n x max``.

    >>> padded_tokens([5, 3, 2])
    15
    """
    return len(lengths) * max(lengths) if lengths else 0


def _runs(order: list[int], lengths: Sequence[int], max_tokens: int | None, max_samples: int) -> list[list[int]]:
    """The fewest runs of ``order`` (sorted longest first) whose padded tokens and samples stay within the caps."""
    runs, i = [], 0
    while i < len(order):
        longest = lengths[order[i]]  # the run's first is its longest
        cap = max_samples if max_tokens is None else min(max_samples, max(1, max_tokens // longest))
        runs.append(order[i : i + cap])
        i += cap
    return runs


def _split_largest(runs: list[list[int]], slots: int) -> list[list[int]]:
    """Split the runs of most samples in two until there are ``slots`` (or every run holds one sample); a part of a
    run pads to no more than the run did."""
    runs = list(runs)
    while len(runs) < slots:
        widest = max(range(len(runs)), key=lambda r: len(runs[r]))
        run = runs[widest]
        if len(run) < 2:
            break
        runs[widest : widest + 1] = [run[: (len(run) + 1) // 2], run[(len(run) + 1) // 2 :]]
    return runs


def _deal_order(num_micro_batches: int, world_size: int) -> list[tuple[int, int]]:
    """The ``(micro, rank)`` slots in the order runs are dealt: micro-batches alternately from the first half and the
    second (which of the two goes first alternates too), ranks in a snake within each.

    >>> _deal_order(4, 2)
    [(0, 0), (0, 1), (2, 1), (2, 0), (3, 0), (3, 1), (1, 1), (1, 0)]
    """
    half = num_micro_batches // 2
    first, second = list(range(half)), list(range(half, num_micro_batches))
    micros: list[int] = []
    for pair, (a, b) in enumerate(zip(first, second, strict=False)):
        micros += [a, b] if pair % 2 == 0 else [b, a]  # neither half always takes the longer of a pair
    micros += second[len(first) :]  # an odd count's last micro-batch
    slots = []
    for visit, micro in enumerate(micros):
        ranks = range(world_size) if visit % 2 == 0 else range(world_size - 1, -1, -1)
        slots += [(micro, rank) for rank in ranks]
    return slots


def plan_token_window(
    lengths: Sequence[int],
    world_size: int,
    max_micro_batch_tokens: int | None,
    max_micro_batch_size: int,
    min_micro_batches: int = 1,
    even_micro_batches: bool = False,
) -> Window:
    """Cut a window holding samples of these ``lengths`` (in the epoch's order) into a ``k x W`` grid of slots.

    ``k`` is the fewest micro-batches the caps allow, at least ``min_micro_batches`` (even if asked), and at most
    what gives every slot a sample; a slot is empty (0 samples, which the data path fills with one zero-weight
    sample) only where the caps need more slots than the window has samples. Weights are the slots' tokens, unpadded.

    >>> window = plan_token_window([2, 9, 3, 8, 2, 7], world_size=1, max_micro_batch_tokens=16, max_micro_batch_size=8,
    ...                            min_micro_batches=2, even_micro_batches=True)
    >>> window.sizes, window.weights, window.order
    (((1,), (1,), (2,), (2,)), ((9,), (2,), (15,), (5,)), (1, 4, 3, 5, 2, 0))

    (Runs within 16 padded tokens, longest first: [9], [8, 7], [3, 2, 2]; four micro-batches for even halves split
    the widest run into [3, 2] and [2]; dealt to the halves A, B, B, A: micro-batches 0 and 2 take [9] and [8, 7],
    3 and 1 take [3, 2] and [2].)
    """
    n = len(lengths)
    if n == 0:
        raise ValueError("a window needs at least one sample")
    order = sorted(range(n), key=lambda i: (-lengths[i], i))  # longest first, ties in the epoch's order
    runs = _runs(order, lengths, max_micro_batch_tokens, max_micro_batch_size)
    fewest = math.ceil(len(runs) / world_size)  # the caps' minimum
    k = max(fewest, min(max(min_micro_batches, fewest), max(1, n // world_size)))
    if even_micro_batches and k % 2 and k < n // world_size:
        k += 1
    runs = _split_largest(runs, k * world_size)
    runs.sort(key=lambda run: (-lengths[run[0]], run[0]))  # longest first again, after the splits
    slots: dict[tuple[int, int], list[int]] = {}
    for slot, run in zip(_deal_order(k, world_size), runs, strict=False):
        slots[slot] = run
    sizes, weights, laid_out = [], [], []
    for micro in range(k):
        row_sizes, row_weights = [], []
        for rank in range(world_size):
            run = slots.get((micro, rank), [])
            row_sizes.append(len(run))
            row_weights.append(sum(lengths[i] for i in run))
            laid_out += run
        sizes.append(tuple(row_sizes))
        weights.append(tuple(row_weights))
    return Window(tuple(sizes), tuple(weights), order=tuple(laid_out))
