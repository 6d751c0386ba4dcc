"""BERT masked-LM pretraining LightningModule: ``transformers.BertForMaskedLM`` built from a config."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM

from lightning_simigrad_recipes.models.common import OptimizerFactory, SchedulerFactory, configure


class MaskedLM(pl.LightningModule):
    """Pretrain a randomly initialized BERT with the masked-LM loss (no weights are downloaded).

    Logs ``train/loss``, ``val/loss`` and ``val/mlm_acc`` (accuracy on the masked tokens).

    Args:
        config: ``transformers.BertConfig`` fields (hidden size, layers, heads...).
        vocab_size: size of the tokenizer's vocabulary (given by the DataModule).
        pad_token_id: the tokenizer's ``[PAD]`` id (given by the DataModule).
        optimizer: a partial optimizer (``conf/optimizer``), called with the parameter groups.
        scheduler: a partial LR scheduler or ``None``.
        scheduler_interval: ``"step"`` or ``"epoch"``.
        decay_norm_and_bias: apply weight decay to biases and LayerNorm weights too (BERT: no).
    """

    def __init__(
        self,
        config: dict[str, Any],
        vocab_size: int,
        pad_token_id: int,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        scheduler_interval: str = "step",
        decay_norm_and_bias: bool = False,
    ) -> None:
        super().__init__()
        bert_config = BertConfig(**dict(config), vocab_size=vocab_size, pad_token_id=pad_token_id)
        self.bert = BertForMaskedLM(bert_config)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.scheduler_interval = scheduler_interval
        self.decay_norm_and_bias = decay_norm_and_bias

    def _step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
        hidden = self.bert.bert(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))[0]
        # The vocabulary projection only where a token is to be predicted (15%): the loss is the same as
        # BertForMaskedLM's over all positions, and on a small model that projection is most of the work.
        masked = batch["labels"] != -100
        targets = batch["labels"][masked]
        logits = self.bert.cls(hidden[masked])
        loss = nn.functional.cross_entropy(logits, targets)
        correct = (logits.argmax(-1) == targets).float().mean()
        return loss, correct, len(batch["input_ids"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _, n = self._step(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=n)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, acc, n = self._step(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=n)
        self.log("val/mlm_acc", acc, sync_dist=True, batch_size=n)

    def configure_optimizers(self) -> Any:
        return configure(self, self.optimizer, self.scheduler, self.scheduler_interval, self.decay_norm_and_bias)
