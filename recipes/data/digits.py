"""scikit-learn's bundled handwritten digits (1797 8x8 grey images, no download): the CPU default."""

from __future__ import annotations

from typing import Any

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset

from lightning_simigrad_recipes.data.base import RecipeDataModule


class DigitsDataModule(RecipeDataModule):
    """``sklearn.datasets.load_digits`` split into train and val, pixels scaled to [0, 1].

    Args:
        num_classes: 10 (the model config reads it).
        val_fraction: share of the 1797 images held out for validation (stratified).
        split_seed: seed of the train/val split (fixed, so runs with different ``seed`` compare).
        **kwargs: ``batch_size``, ``num_workers``... of :class:`RecipeDataModule`.
    """

    def __init__(self, num_classes: int = 10, val_fraction: float = 0.2, split_seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.num_classes = num_classes

    def _build(self) -> None:
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # N x 1 x 8 x 8
        labels = torch.tensor(digits.target, dtype=torch.long)
        train_idx, val_idx = train_test_split(
            range(len(labels)), test_size=self.val_fraction, stratify=labels, random_state=self.split_seed
        )
        self.train_set = TensorDataset(images[train_idx], labels[train_idx])
        self.val_set = TensorDataset(images[val_idx], labels[val_idx])
