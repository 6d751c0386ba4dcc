"""Image classification LightningModule: any ``nn.Module`` net, cross-entropy, top-1/top-5 accuracy."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_simigrad_recipes.models.common import OptimizerFactory, SchedulerFactory, configure


class ImageClassifier(pl.LightningModule):
    """Train ``net`` with cross-entropy; log ``train/loss``, ``val/loss``, ``val/acc1``, ``val/acc5``.

    Args:
        net: the network (Hydra instantiates it from ``model.net``).
        num_classes: number of outputs, for the accuracy metrics.
        optimizer: a partial optimizer (``conf/optimizer``), called with the parameter groups.
        scheduler: a partial LR scheduler (``conf/scheduler``) or ``None``.
        scheduler_interval: ``"epoch"`` or ``"step"``.
        label_smoothing: cross-entropy label smoothing.
        decay_norm_and_bias: apply weight decay to biases and norm weights too.
    """

    def __init__(
        self,
        net: nn.Module,
        num_classes: int,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        scheduler_interval: str = "epoch",
        label_smoothing: float = 0.0,
        decay_norm_and_bias: bool = True,
    ) -> None:
        super().__init__()
        self.net = net
        self.optimizer, self.scheduler = optimizer, scheduler
        self.scheduler_interval = scheduler_interval
        self.decay_norm_and_bias = decay_norm_and_bias
        self.loss = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.train_acc1 = MulticlassAccuracy(num_classes, top_k=1)
        self.val_acc1 = MulticlassAccuracy(num_classes, top_k=1)
        self.val_acc5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.loss(logits, y)
        self.train_acc1(logits, y)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(y))
        self.log("train/acc1", self.train_acc1, on_step=False, on_epoch=True, batch_size=len(y))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc1(logits, y)
        self.val_acc5(logits, y)
        self.log("val/loss", self.loss(logits, y), prog_bar=True, sync_dist=True, batch_size=len(y))
        self.log("val/acc1", self.val_acc1, prog_bar=True, batch_size=len(y))
        self.log("val/acc5", self.val_acc5, batch_size=len(y))

    def configure_optimizers(self) -> Any:
        return configure(self, self.optimizer, self.scheduler, self.scheduler_interval, self.decay_norm_and_bias)
