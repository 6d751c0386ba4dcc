"""An ImageFolder tree (``root/train/<class>/*.JPEG``, ``root/val/<class>/*.JPEG``), e.g. ImageNet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from torchvision import datasets
from torchvision.transforms import v2

from lightning_simigrad_recipes.data.base import RecipeDataModule
from lightning_simigrad_recipes.errors import RecipeError

# ImageNet channel statistics, as in torchvision's reference scripts.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
LAYOUT = "expected data.root/train/<class>/<image> and data.root/val/<class>/<image>"


def open_split(root: Path, split: str) -> datasets.ImageFolder:
    """Scan one split, turning torchvision's errors into one-line ``RecipeError``s."""
    folder = root / split
    if not folder.is_dir():
        raise RecipeError(f"{folder} does not exist: {LAYOUT} (the val images sorted into class folders)")
    try:
        dataset = datasets.ImageFolder(str(folder))
    except FileNotFoundError as err:  # no class folders, or class folders without images
        raise RecipeError(f"{folder} is not an ImageFolder tree ({err}); {LAYOUT}") from None
    first_path = dataset.samples[0][0]
    try:
        with Image.open(first_path) as image:
            image.convert("RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise RecipeError(f"{first_path} is not a readable image ({err}); check the files under {folder}") from None
    return dataset


class ImageFolderDataModule(RecipeDataModule):
    """ImageNet-style training: RandomResizedCrop + flip; val resize then center crop.

    Args:
        root: the folder holding ``train/`` and ``val/``.
        num_classes: output size of the model; must be at least the number of class folders.
        image_size: crop size (224 for ImageNet; ``debug=smoke`` uses 32).
        val_resize: shorter side before the val center crop (256 for 224 crops).
        **kwargs: ``batch_size``, ``num_workers``... of :class:`RecipeDataModule`.
    """

    def __init__(
        self,
        root: str | None = None,
        num_classes: int = 1000,
        image_size: int = 224,
        val_resize: int = 256,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.root = root
        self.num_classes = num_classes
        self.image_size = image_size
        self.val_resize = val_resize

    def _build(self) -> None:
        if not self.root:
            raise RecipeError(
                f"data.root is not set: give the ImageNet folder, e.g. data.root=/data/imagenet ({LAYOUT})"
            )
        root = Path(self.root).expanduser()
        if not root.is_dir():
            raise RecipeError(f"data.root={self.root} does not exist; {LAYOUT}")
        train, val = open_split(root, "train"), open_split(root, "val")
        if len(train.classes) > self.num_classes:
            raise RecipeError(
                f"{root / 'train'} has {len(train.classes)} class folders but data.num_classes={self.num_classes}; "
                f"set data.num_classes={len(train.classes)}"
            )
        unknown = sorted(set(val.classes) - set(train.classes))
        if unknown:
            raise RecipeError(
                f"{root / 'val'} has class folders missing from train/: {', '.join(unknown[:5])}; {LAYOUT}"
            )
        # ImageFolder numbers classes by sorted folder name per split: give val the train numbering.
        val.samples = [(path, train.class_to_idx[val.classes[label]]) for path, label in val.samples]
        val.targets = [label for _, label in val.samples]
        to_tensor = [v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
        train.transform = v2.Compose([v2.RandomResizedCrop(self.image_size), v2.RandomHorizontalFlip(), *to_tensor])
        val.transform = v2.Compose([v2.Resize(self.val_resize), v2.CenterCrop(self.image_size), *to_tensor])
        self.train_set, self.val_set = train, val
