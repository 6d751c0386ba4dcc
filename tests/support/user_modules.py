"""LightningModules and DataModules written the way Lightning users write them, without SimiGrad in mind.

Each follows a common source: Lightning's image-classifier example (a DataModule, `save_hyperparameters`,
`self.log`, validation/test/predict steps), the BoringModel of Lightning's own tests (dict returns), the
transformer fine-tuning tutorial (`get_linear_schedule_with_warmup` over `estimated_stepping_batches`),
and a small BatchNorm network. Their datasets return the sample's index beside the data, and the modules
record every micro-batch they train on, so tests can check exactly which samples each step averaged.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, random_split


class IndexedImages(Dataset):
    """Random 8x8 "images" of 4 classes that depend on the pixels; item ``i`` is ``(i, image, label)``."""

    def __init__(self, n: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(n, 1, 8, 8, generator=g)
        self.labels = (self.images[:, 0, :4, :4].sum((1, 2)) > 0).long() + 2 * (
            self.images[:, 0, 4:, 4:].mean((1, 2)) > 0
        )

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return i, self.images[i], self.labels[i]


class ImagesDataModule(pl.LightningDataModule):
    """As in Lightning's examples: `setup` splits, the `*_dataloader` methods read `self.batch_size`."""

    def __init__(self, n: int = 256, batch_size: int = 16, num_workers: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        full = IndexedImages(self.hparams.n)
        n_val = self.hparams.n // 8
        self.train_set, self.val_set = random_split(
            full, [self.hparams.n - n_val, n_val], generator=torch.Generator().manual_seed(42)
        )
        self.test_set = self.predict_set = self.val_set

    def train_dataloader(self):
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.hparams.num_workers
        )

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test_set, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.predict_set, batch_size=self.batch_size)


class LitClassifier(pl.LightningModule):
    """Lightning's example classifier: a small CNN, cross-entropy, Adam, logged loss and accuracy."""

    def __init__(self, lr: float = 1e-2, batch_norm: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        norm = nn.BatchNorm2d(8) if batch_norm else nn.Identity()
        self.net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), norm, nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 4))
        self.micro_batches: list[list[int]] = []
        self.validated: list[int] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        self.micro_batches.append(idx.tolist())
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        idx, x, y = batch
        self.validated.extend(idx.tolist())
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def test_step(self, batch, batch_idx):
        _, x, y = batch
        self.log("test_acc", (self(x).argmax(1) == y).float().mean())

    def predict_step(self, batch, batch_idx):
        idx, x, _ = batch
        return idx, self(x).argmax(1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class RandomDataset(Dataset):
    """The BoringModel's data, with indices."""

    def __init__(self, size: int = 32, length: int = 128) -> None:
        self.data = torch.randn(length, size, generator=torch.Generator().manual_seed(1))

    def __getitem__(self, index):
        return index, self.data[index]

    def __len__(self) -> int:
        return len(self.data)


class BoringModel(pl.LightningModule):
    """As in Lightning's tests: one linear layer, `training_step` returns a dict, SGD + StepLR."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(32, 2)
        self.micro_batches: list[list[int]] = []

    def loss(self, x):
        return self.layer(x).pow(2).mean()  # a mean over the micro-batch, like every torch loss

    def training_step(self, batch, batch_idx):
        idx, x = batch
        self.micro_batches.append(idx.tolist())
        return {"loss": self.loss(x), "batch_idx": batch_idx}

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 128), batch_size=8, shuffle=True)


class TransformerStyle(BoringModel):
    """The transformer fine-tuning tutorial's optimizer: AdamW with linear warm-up and decay over the fit."""

    def configure_optimizers(self):
        from transformers import get_linear_schedule_with_warmup

        optimizer = torch.optim.AdamW(self.parameters(), lr=2e-2, eps=1e-8)
        scheduler = get_linear_schedule_with_warmup(
            optimizer, num_warmup_steps=2, num_training_steps=self.trainer.estimated_stepping_batches
        )
        return [optimizer], [{"scheduler": scheduler, "interval": "step", "frequency": 1}]


class BatchNormNet(pl.LightningModule):
    """A small MLP with BatchNorm, which refuses a training micro-batch of one sample."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.micro_batches: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        idx, x = batch
        self.micro_batches.append(idx.tolist())
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
