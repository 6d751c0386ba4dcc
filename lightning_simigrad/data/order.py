"""Where an epoch's samples come from, for map-style data: the order of the dataset's indices.

An :class:`EpochOrder` is the *source* half of the data path (the window plan is the core's
:mod:`~lightning_simigrad.core.plan`, the walk over an epoch :mod:`~lightning_simigrad.data.windows`, and the
batch sampler that hands each rank its micro-batches :mod:`~lightning_simigrad.data.sampler`). All ranks walk the
same order and each takes its slots of every window, so every sample is fed once per epoch with no padding. The
order must be one every rank can draw alike and a resumed run can draw again: a ``RandomSampler`` without
replacement (permuted with SimiGrad's seed and the epoch), a ``SequentialSampler``, or the settings of a
``DistributedSampler`` Lightning injects. Any other sampler is followed as it comes, on one process only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

from lightning_simigrad import _compat

__all__ = ["EpochOrder", "shuffles"]


def shuffles(sampler: Any) -> bool | None:
    """Whether the sampler's order is a permutation SimiGrad regenerates (True), the sequence (False), or an order it
    can only take as it comes (None: a sampler with replacement, of its own length, weighted or of the user's own),
    which a resumed run cannot pick up in the middle of an epoch."""
    if isinstance(sampler, DistributedSampler):
        return sampler.shuffle
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or _compat.random_sampler_length(sampler) is not None:
            return None  # a sampler with replacement or its own length has an order we can't regenerate
        return True
    if isinstance(sampler, SequentialSampler):
        return False
    return None


class EpochOrder:
    """An epoch's order of dataset indices, identical on every rank and again after a resume.

    Args:
        sampler: the DataLoader's sampler (see the module docstring).
        seed: the shuffling seed every rank agreed on; epoch ``e`` is permuted with ``seed + e``.
    """

    def __init__(self, sampler: Any, seed: int = 0) -> None:
        self.sampler = sampler
        self.seed = seed

    @property
    def regenerable(self) -> bool:
        """Every rank, and a resumed run, can draw this order again."""
        return shuffles(self.sampler) is not None

    @property
    def name(self) -> str:
        return type(self.sampler).__name__

    def __len__(self) -> int:
        return len(self.sampler)

    def dataset_length(self) -> int:
        """The size of the dataset behind an order SimiGrad generates itself."""
        sampler = self.sampler
        if isinstance(sampler, DistributedSampler):
            return len(sampler.dataset)  # type: ignore[arg-type]
        return len(sampler.data_source)

    def epoch(self, epoch: int) -> torch.Tensor:
        """The global index order of ``epoch``, as int64: 8 bytes an index where a list of Python ints takes about 36
        (0.9 GB per process for the 25M sequences of BERT's corpus at 128 tokens)."""
        shuffle = shuffles(self.sampler)
        if shuffle is None:
            return torch.tensor(list(iter(self.sampler)), dtype=torch.int64)
        n = self.dataset_length()
        if not shuffle:
            return torch.arange(n, dtype=torch.int64)
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=generator)
