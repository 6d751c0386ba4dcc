"""Windows planned in tokens: which of a window's sequences go together into a micro-batch, on which rank.

Where batches are counted in tokens (``SimiGrad(lengths=...)``), the data path decides first *which* samples a window
holds (consecutive samples of the epoch's order, until their tokens reach the batch asked for) and then, here, how
they are cut into ``k`` micro-batches on each of ``W`` ranks so that:

- every slot's *padded* tokens -- its samples times its longest sample -- stay within ``max_micro_batch_tokens``
  (the memory bound, whatever the lengths), and its samples within ``max_micro_batch_size``;
- the window's halves and ranks hold alike tokens of alike lengths: its samples, sorted longest first, are dealt in a
  snake order to *cells* -- each rank's share, and where the halves are in time (one process, FSDP2) each rank's
  share of each half -- so every cell spans every length and the cells' tokens differ by at most one sequence.
  Halves of unequal tokens, or the short sequences in one half and the long in the other, would make the halves'
  gradients differ for a reason that is not noise and bias the similarity low;
- samples of similar length share a slot: each cell's samples are cut into runs, longest first, which cuts padding
  as a length-grouped sampler does without changing which samples the window holds;
- every rank runs the same number of micro-batches (a window is a ``k x W`` grid), as FSDP's collectives need: a
  cell that needs fewer runs than another has its runs dealt into more parts.

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
    """Split runs into parts until there are ``slots`` (or every part holds one sample): each new part goes to the
    run whose parts are then the largest, so a run cut into ``m`` parts gives parts within one sample of each other
    (three slots from one run: thirds, not a half and two quarters). A part of a run pads to no more than the run.

    A run is dealt to its parts in turn, not cut in pieces: it is sorted longest first, and cut, its long sequences
    would go to one micro-batch and its short ones to the next. Dealt, two parts' tokens differ by at most the run's
    longest less its shortest.

    >>> _split_largest([[0, 1, 2, 3, 4]], 2)
    [[0, 2, 4], [1, 3]]
    >>> _split_largest([[0, 1, 2, 3, 4, 5], [6]], 4)
    [[0, 3], [1, 4], [2, 5], [6]]
    """
    parts = [1] * len(runs)
    while runs and sum(parts) < slots:
        widest = max(range(len(runs)), key=lambda r: len(runs[r]) / parts[r])
        if len(runs[widest]) <= parts[widest]:
            break  # every part holds one sample
        parts[widest] += 1
    return [run[j::m] for run, m in zip(runs, parts, strict=True) for j in range(m)]


def _deal_to_cells(order: list[int], cells: int) -> list[list[int]]:
    """The window's samples, sorted longest first, dealt to ``cells`` in a snake order: each cell spans every length
    and the cells' tokens differ by at most the longest sequence.

    >>> _deal_to_cells([0, 1, 2, 3, 4, 5], 2)
    [[0, 3, 4], [1, 2, 5]]
    """
    dealt: list[list[int]] = [[] for _ in range(cells)]
    for i, sample in enumerate(order):
        lap, seat = divmod(i, cells)
        dealt[seat if lap % 2 == 0 else cells - 1 - seat].append(sample)
    return dealt


def plan_token_window(
    lengths: Sequence[int],
    world_size: int,
    max_micro_batch_tokens: int | None,
    max_micro_batch_size: int,
    min_micro_batches: int = 1,
    even_micro_batches: bool = False,
) -> Window:
    """Cut a window holding samples of these ``lengths`` (in the epoch's order) into a ``k x W`` grid of slots.

    ``k`` is the fewest micro-batches the caps allow for every cell (see the module's notes), at least
    ``min_micro_batches`` (even if asked), and at most what gives every slot a sample; a slot is empty (0 samples,
    which the data path fills with one zero-weight sample) only where the caps need more slots than the window has
    samples. Weights are the slots' tokens, unpadded.

    >>> window = plan_token_window([2, 9, 3, 8, 2, 7], world_size=1, max_micro_batch_tokens=16, max_micro_batch_size=8,
    ...                            min_micro_batches=2, even_micro_batches=True)
    >>> window.sizes, window.weights, window.order
    (((1,), (2,), (2,), (1,)), ((9,), (5,), (15,), (2,)), (1, 2, 0, 3, 5, 4))

    (Sorted longest first, 9 8 7 3 2 2, dealt in a snake to the halves: A takes 9, 3, 2 and B 8, 7, 2, 14 tokens
    against 17; within 16 padded tokens A runs [9] and [3, 2], B [8, 7] and [2].)
    """
    n = len(lengths)
    if n == 0:
        raise ValueError("a window needs at least one sample")
    order = sorted(range(n), key=lambda i: (-lengths[i], i))  # longest first, ties in the epoch's order
    # the cells: each rank's share, and with halves in time each rank's share of each half
    halves = 2 if even_micro_batches and n // world_size >= 2 else 1
    cells = _deal_to_cells(order, halves * world_size)
    cell_runs = [_runs(cell, lengths, max_micro_batch_tokens, max_micro_batch_size) for cell in cells]
    fewest = max(len(runs) for runs in cell_runs)  # the caps' minimum, per cell
    per_cell = max(fewest, min(math.ceil(min_micro_batches / halves), max(1, min(len(c) for c in cells))))
    k = halves * per_cell
    slots: dict[tuple[int, int], list[int]] = {}
    for index in range(len(cells)):
        half, rank = divmod(index, world_size)
        parts = _split_largest(cell_runs[index], per_cell)
        parts.sort(key=lambda part: (-lengths[part[0]], part[0]))  # longest first
        for j, part in enumerate(parts):
            slots[(half * per_cell + j, rank)] = part
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
