"""CIFAR-10 read from the python batch files on disk (``data_batch_1..5``, ``test_batch``): no download."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

from lightning_simigrad_recipes.data.base import RecipeDataModule
from lightning_simigrad_recipes.errors import RecipeError

TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_FILE = "test_batch"
# The per-channel statistics the paper's code (kuangliu/pytorch-cifar) normalizes with.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2023, 0.1994, 0.2010)
HOW_TO_GET = (
    "download and extract cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html "
    "and set data.root to the extracted cifar-10-batches-py folder"
)


def find_batches_dir(root: str | None) -> Path:
    """Return the folder holding the batch files: ``root`` itself or ``root/cifar-10-batches-py``."""
    if not root:
        raise RecipeError(f"data.root is not set: {HOW_TO_GET}")
    path = Path(root).expanduser()
    if not path.is_dir():
        raise RecipeError(f"data.root={root} is not a directory: {HOW_TO_GET}")
    for candidate in (path, path / "cifar-10-batches-py"):
        if (candidate / TEST_FILE).is_file():
            path = candidate
            break
    missing = [name for name in [*TRAIN_FILES, TEST_FILE] if not (path / name).is_file()]
    if missing:
        raise RecipeError(f"data.root={root} lacks the CIFAR-10 files {', '.join(missing)}: {HOW_TO_GET}")
    return path


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read one pickled batch: ``b"data"`` (N x 3072 uint8, channel-major) and ``b"labels"``."""
    try:
        with path.open("rb") as f:
            batch = pickle.load(f, encoding="bytes")
        data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError) as err:
        raise RecipeError(
            f"{path} is not a CIFAR-10 python batch (a pickled dict with b'data' N x 3072 uint8 and "
            f"b'labels'): {type(err).__name__}: {err}; {HOW_TO_GET}"
        ) from None
    if len(data) != len(labels):
        raise RecipeError(f"{path} holds {len(data)} images but {len(labels)} labels; re-extract the archive")
    return data, labels


class ImageTensorDataset(Dataset[tuple[torch.Tensor, int]]):
    """uint8 images (N x C x H x W) in memory with a torchvision v2 transform applied per item."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: v2.Transform) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.images[index]), int(self.labels[index])


class CIFAR10DataModule(RecipeDataModule):
    """CIFAR-10 with the paper code's augmentation (random crop 32 with 4-pixel padding, flip).

    Args:
        root: the ``cifar-10-batches-py`` folder (or its parent).
        num_classes: 10; checked against the labels found.
        **kwargs: ``batch_size``, ``num_workers``... of :class:`RecipeDataModule`.
    """

    def __init__(self, root: str | None = None, num_classes: int = 10, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.root = root
        self.num_classes = num_classes

    def _build(self) -> None:
        folder = find_batches_dir(self.root)
        parts = [read_batch(folder / name) for name in TRAIN_FILES]
        train_x = torch.from_numpy(np.concatenate([p[0] for p in parts]))
        train_y = torch.from_numpy(np.concatenate([p[1] for p in parts]))
        test_x, test_y = (torch.from_numpy(a) for a in read_batch(folder / TEST_FILE))
        top = int(max(train_y.max(), test_y.max()))
        if top >= self.num_classes:
            raise RecipeError(f"labels go up to {top} but data.num_classes={self.num_classes}; fix data.num_classes")
        normalize = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
        train_tf = v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), *normalize])
        self.train_set = ImageTensorDataset(train_x, train_y, train_tf)
        self.val_set = ImageTensorDataset(test_x, test_y, v2.Compose(normalize))
