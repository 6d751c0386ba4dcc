"""Every sample's size in tokens, where batches are counted in tokens (``SimiGrad(lengths=...)``).

The lengths are read once, when the training data arrives, into one int64 tensor indexed like the dataset (8 bytes
a sample), which every window is planned from: a sequence the user gives (as length-grouped samplers take one), or
a function of a sample applied to every sample of the dataset (which reads the whole dataset once, in the main
process; give the sequence where that is slow). Every rank reads the same lengths, so every rank plans the same
windows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["sample_lengths"]


def sample_lengths(
    lengths: Sequence[int] | Callable[[Any], Any], dataset: Any, max_micro_batch_tokens: int | None
) -> torch.Tensor:
    """The tokens of every sample of ``dataset``, checked: one positive int per sample, none above
    ``max_micro_batch_tokens`` (such a sample could not be fed within the bound)."""
    size = len(dataset)
    if callable(lengths):
        tokens = torch.tensor([_tokens(lengths, dataset, i) for i in range(size)], dtype=torch.int64)
        where = "`lengths(sample)`"
    else:
        tokens = torch.as_tensor(lengths)
        where = "`lengths`"
        if tokens.ndim != 1 or tokens.is_floating_point() or tokens.is_complex():
            raise ValueError(
                f"`lengths` must hold one int per sample of the training dataset, got a {tuple(tokens.shape)}"
                f" {tokens.dtype} array. Give a list of ints, or a function of a sample returning its tokens."
            )
        tokens = tokens.to(torch.int64)
        if len(tokens) != size:
            raise ValueError(
                f"`lengths` holds {len(tokens)} lengths but the training dataset has {size} samples: give one"
                " length per sample, in the dataset's index order."
            )
    if size and int(tokens.min()) < 1:
        index = int(tokens.argmin())
        raise ValueError(
            f"{where} gives sample {index} {int(tokens[index])} tokens; every sample needs at least one. Drop empty"
            " samples from the dataset."
        )
    if size and max_micro_batch_tokens is not None and int(tokens.max()) > max_micro_batch_tokens:
        index = int(tokens.argmax())
        raise ValueError(
            f"Sample {index} has {int(tokens[index])} tokens, more than `max_micro_batch_tokens="
            f"{max_micro_batch_tokens}`: it could not be fed within the bound. Raise `max_micro_batch_tokens` to at"
            f" least {int(tokens.max())}, or truncate the longest sequences."
        )
    return tokens


def _tokens(lengths: Callable[[Any], Any], dataset: Any, index: int) -> int:
    """``lengths(dataset[index])``, which must be a whole number of tokens (a Python or NumPy int, a one-element
    tensor, or a float with no fraction)."""
    value = lengths(dataset[index])
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if hasattr(value, "__index__") and not isinstance(value, bool):
        return int(value.__index__())
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError(
        f"`lengths(sample)` returned {value!r} for sample {index}; it must return the sample's number of tokens, an"
        " int. For example `lengths=lambda sample: len(sample['input_ids'])`."
    )
