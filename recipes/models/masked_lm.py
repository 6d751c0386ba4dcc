"""BERT masked-LM pretraining LightningModule: ``transformers.BertForMaskedLM`` built from a config.

``model.init_from`` starts the model from an earlier masked-LM run's ``.ckpt`` (phase 2 from phase 1): its encoder
and its masked-LM head, weights only (``recipes/models/pretrained.py``); the optimizer, the LR schedule and
SimiGrad's batch start afresh, as a new phase (``conf/experiment/bert_large_phase2.yaml`` says why).

Under ``trainer=fsdp`` (Lightning's ``ModelParallelStrategy``, ``recipes/strategies.py``) the module shards itself in
``configure_model``: ``fully_shard`` on every encoder layer, then on the whole module (embeddings, the tied MLM head
and the last LayerNorms form the root's unit). FSDP2 gathers a unit's parameters around that unit's ``forward``, so
``training_step`` and ``validation_step`` go through ``forward``. Every other strategy sees the unsharded module.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from transformers import BertForMaskedLM

from lightning_simigrad_recipes.errors import RecipeError
from lightning_simigrad_recipes.models.bert_config import bert_config
from lightning_simigrad_recipes.models.common import OptimizerFactory, SchedulerFactory, configure, shard_blocks
from lightning_simigrad_recipes.models.pretrained import load_pretrained
from lightning_simigrad_recipes.optim import ShardedLamb


class MaskedLM(pl.LightningModule):
    """Pretrain BERT with the masked-LM loss, from a random init or an earlier run's weights (none downloaded).

    Logs ``train/loss``, ``val/loss`` and ``val/mlm_acc`` (accuracy on the masked tokens).

    Args:
        config: ``transformers.BertConfig`` fields (hidden size, layers, heads...).
        vocab_size: size of the tokenizer's vocabulary (given by the DataModule).
        pad_token_id: the tokenizer's ``[PAD]`` id (given by the DataModule).
        optimizer: a partial optimizer (``conf/optimizer``), called with the parameter groups.
        scheduler: a partial LR scheduler or ``None``.
        scheduler_interval: ``"step"`` or ``"epoch"``.
        decay_norm_and_bias: apply weight decay to biases and LayerNorm weights too (BERT: no).
        init_from: a masked-LM checkpoint of these recipes whose encoder and head start the model (``None``: random
            init).
        max_seq_length: the DataModule's sequence length, checked against ``max_position_embeddings``.
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
        init_from: str | None = None,
        max_seq_length: int | None = None,
    ) -> None:
        super().__init__()
        self.bert = BertForMaskedLM(bert_config(config, vocab_size, pad_token_id, max_seq_length))
        # encoder and head: phase 2 continues phase 1's masked-LM task, so nothing starts fresh
        self.init_report = load_pretrained(self.bert, init_from, parts=("bert", "cls")) if init_from else None
        self.optimizer, self.scheduler = optimizer, scheduler
        self.scheduler_interval = scheduler_interval
        self.decay_norm_and_bias = decay_norm_and_bias

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy``: ``fully_shard`` per encoder layer, then the root, over the data mesh."""
        shard_blocks(self, self.bert.bert.encoder.layer)

    @staticmethod
    def loss_items(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """SimiGrad's ``loss_items``: a micro-batch's masked tokens, over which its loss is the mean."""
        return (batch["labels"] != -100).sum()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        """The logits at the masked positions and their target tokens."""
        hidden = self.bert.bert(input_ids=input_ids, attention_mask=attention_mask)[0]
        # The vocabulary projection only where a token is to be predicted (15%): the loss is the same as
        # BertForMaskedLM's over all positions, and on a small model that projection is most of the work.
        masked = labels != -100
        return self.bert.cls(hidden[masked]), labels[masked]

    def _step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
        logits, targets = self(batch["input_ids"], batch["labels"], batch.get("attention_mask"))
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
        optimizer = self.optimizer
        if getattr(self, "fully_sharded", False):
            optimizer = _for_sharded_parameters(optimizer)
        return configure(self, optimizer, self.scheduler, self.scheduler_interval, self.decay_norm_and_bias)


def _for_sharded_parameters(optimizer: OptimizerFactory) -> OptimizerFactory:
    """``pytorch_optimizer.Lamb`` cannot take norms of FSDP2's DTensors: the same LAMB, sharded (recipes/optim.py)."""
    func = getattr(optimizer, "func", None)
    if func is None or f"{func.__module__}.{func.__qualname__}".split(".")[0] != "pytorch_optimizer":
        return optimizer
    if func.__name__ != "Lamb":
        raise RecipeError(
            f"trainer=fsdp: pytorch_optimizer.{func.__name__} does not support sharded parameters;"
            " use optimizer=lamb, adamw or sgd"
        )
    keywords = dict(optimizer.keywords)  # type: ignore[attr-defined]
    unsupported = set(keywords) - {"lr", "betas", "weight_decay", "eps"}
    if unsupported:
        raise RecipeError(
            f"trainer=fsdp: the sharded LAMB takes lr, betas, weight_decay and eps, not {sorted(unsupported)}"
        )
    return functools.partial(ShardedLamb, *optimizer.args, **keywords)  # type: ignore[attr-defined]
