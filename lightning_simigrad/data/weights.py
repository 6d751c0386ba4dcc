"""Every sample's weight, where the unit weighs samples unalike: its tokens (``SimiGrad(lengths=...)``), or a weight
of the user's own (``SimiGrad(unit=Unit(..., per_sample=...))``).

The weights are read once, when the training data arrives, into one int64 tensor indexed like the dataset (8 bytes
a sample), which every window is planned from: a sequence the user gives (as length-grouped samplers take one), or
a function of a sample applied to every sample of the dataset (which reads the whole dataset once, in the main
process; give the sequence where that is slow). Every rank reads the same weights, so every rank plans the same
windows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_simigrad.core.units import Unit

__all__ = ["sample_weights"]


def sample_weights(unit: Unit, dataset: Any) -> torch.Tensor | None:
    """The weight of every sample of ``dataset`` in ``unit``, checked: one positive int per sample, none above the
    unit's slot bound (such a sample could not be fed within it); None where every sample weighs 1."""
    per_sample, name, size = unit.per_sample, unit.name, len(dataset)
    if per_sample is None:
        return None
    if callable(per_sample):
        weights = torch.tensor([_weight(per_sample, unit, dataset, i) for i in range(size)], dtype=torch.int64)
        where = f"`{unit.setting}(sample)`"
    else:
        weights = torch.as_tensor(per_sample)
        where = f"`{unit.setting}`"
        if weights.ndim != 1 or weights.is_floating_point() or weights.is_complex():
            raise ValueError(
                f"{where} must hold one int per sample of the training dataset, got a {tuple(weights.shape)}"
                f" {weights.dtype} array. Give a list of ints, or a function of a sample returning its {name}."
            )
        weights = weights.to(torch.int64)
        if len(weights) != size:
            raise ValueError(
                f"{where} holds {len(weights)} lengths but the training dataset has {size} samples: give one"
                " length per sample, in the dataset's index order."
            )
    if size and int(weights.min()) < 1:
        index = int(weights.argmin())
        raise ValueError(
            f"{where} gives sample {index} {int(weights[index])} {name}; every sample needs at least one. Drop empty"
            " samples from the dataset."
        )
    bound = unit.max_slot_weight
    if size and bound is not None and int(weights.max()) > bound:
        index = int(weights.argmax())
        raise ValueError(
            f"Sample {index} has {int(weights[index])} {name}, more than `max_micro_batch_tokens={bound}`: it could"
            f" not be fed within the bound. Raise `max_micro_batch_tokens` to at least {int(weights.max())}, or"
            " truncate the longest sequences."
        )
    return weights


def _weight(per_sample: Callable[[Any], Any], unit: Unit, dataset: Any, index: int) -> int:
    """``per_sample(dataset[index])``, which must be a whole number (a Python or NumPy int, a one-element integer
    tensor, or a float with no fraction)."""
    value = per_sample(dataset[index])
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if hasattr(value, "__index__") and not isinstance(value, bool):
        return int(value.__index__())
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError(
        f"`{unit.setting}(sample)` returned {value!r} for sample {index}; it must return the sample's number of"
        f" {unit.name}, an int. For example `lengths=lambda sample: len(sample['input_ids'])`."
    )
