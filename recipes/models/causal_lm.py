"""GPT-style causal-LM LightningModule: ``transformers.GPT2LMHeadModel`` built from a config (nothing downloaded).

Each labelled token (``labels != -100``) is predicted from the tokens before it: the logits at position ``t`` are
scored against the label at ``t + 1``, so a sample's first token, which has nothing before it, is never predicted,
and a sample of ``n`` tokens holds ``n - 1`` predictions. ``training_step`` returns the mean cross-entropy over the
micro-batch's predicted tokens, a number that varies from micro-batch to micro-batch with the lengths;
:meth:`CausalLM.loss_items` counts exactly those tokens, so SimiGrad weighs every token of a step alike
(docs/usage.md "Language models: loss items").

Under ``trainer=fsdp`` (Lightning's ``ModelParallelStrategy``) the module shards itself in ``configure_model``:
``fully_shard`` on every transformer block, then on the whole module (the tied embeddings and LM head, the final
LayerNorm), as the BERT recipes do; ``training_step`` and ``validation_step`` go through ``forward``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_simigrad_recipes.errors import RecipeError
from lightning_simigrad_recipes.models.common import OptimizerFactory, SchedulerFactory, configure, shard_blocks
from lightning_simigrad_recipes.models.masked_lm import _for_sharded_parameters


def gpt2_config(config: dict[str, Any], vocab_size: int, pad_token_id: int, max_seq_length: int | None) -> GPT2Config:
    """``model.config`` with the tokenizer's vocabulary; the data's ``max_seq_length`` must fit ``n_positions``."""
    # GPT-2's bos/eos id (50256) lies outside a vocabulary of our own; the samples hold no special tokens
    built = GPT2Config(
        **{"bos_token_id": None, "eos_token_id": None, **config}, vocab_size=vocab_size, pad_token_id=pad_token_id
    )
    if max_seq_length is not None and max_seq_length > built.n_positions:
        raise RecipeError(
            f"data.max_seq_length={max_seq_length} exceeds model.config.n_positions={built.n_positions};"
            " lower data.max_seq_length or raise model.config.n_positions"
        )
    return built


class CausalLM(pl.LightningModule):
    """Train a GPT-2-style decoder with next-token cross-entropy, from a random init.

    Logs ``train/loss``, ``val/loss`` (the mean over every predicted validation token) and ``val/acc`` (their
    next-token accuracy); the validation perplexity is ``exp(val/loss)``.

    Args:
        config: ``transformers.GPT2Config`` fields (``n_embd``, ``n_layer``, ``n_head``, ``n_positions``...).
        vocab_size: size of the tokenizer's vocabulary (given by the DataModule).
        pad_token_id: the tokenizer's padding id (given by the DataModule).
        optimizer: a partial optimizer (``conf/optimizer``), called with the parameter groups.
        scheduler: a partial LR scheduler or ``None``.
        scheduler_interval: ``"step"`` or ``"epoch"``.
        decay_norm_and_bias: apply weight decay to biases and LayerNorm weights too (GPT-2: no).
        max_seq_length: the DataModule's longest sample, checked against ``n_positions``.
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
        max_seq_length: int | None = None,
    ) -> None:
        super().__init__()
        self.gpt = GPT2LMHeadModel(gpt2_config(config, vocab_size, pad_token_id, max_seq_length))
        self.optimizer, self.scheduler = optimizer, scheduler
        self.scheduler_interval = scheduler_interval
        self.decay_norm_and_bias = decay_norm_and_bias

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy``: ``fully_shard`` per transformer block, then the root, over the data mesh."""
        shard_blocks(self, self.gpt.transformer.h)

    @staticmethod
    def loss_items(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """SimiGrad's ``loss_items``: the tokens a micro-batch's loss averages over, the labelled ones that have a
        token before them (``labels[:, 1:]``: position 0 of a sample is never predicted)."""
        return (batch["labels"][:, 1:] != -100).sum()

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of the predicted tokens and their targets: position ``t``'s logits for the label at ``t + 1``."""
        hidden = self.gpt.transformer(input_ids=input_ids, attention_mask=attention_mask)[0]
        targets = labels[:, 1:]
        predicted = targets != -100
        # the vocabulary projection only where a token is predicted (not on the padding nor the last position):
        # the same loss as GPT2LMHeadModel's, and on a small model that projection is most of the work
        return self.gpt.lm_head(hidden[:, :-1][predicted]), targets[predicted]

    def _step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
        logits, targets = self(batch["input_ids"], batch["labels"], batch.get("attention_mask"))
        # the mean over the predicted tokens; a micro-batch of one-token samples predicts none, and its loss is 0,
        # not cross_entropy's NaN (SimiGrad weighs it by its 0 items)
        loss = nn.functional.cross_entropy(logits, targets, reduction="sum") / max(len(targets), 1)
        correct = (logits.argmax(-1) == targets).float().sum() / max(len(targets), 1)
        return loss, correct, len(targets)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _, n = self._step(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=max(n, 1))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, acc, n = self._step(batch)
        if n == 0:  # one-token samples only: nothing to score
            return
        # weighed by the predicted tokens: the epoch's values are means over every validation token
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=n)
        self.log("val/acc", acc, sync_dist=True, batch_size=n)

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer
        if getattr(self, "fully_sharded", False):
            optimizer = _for_sharded_parameters(optimizer)
        return configure(self, optimizer, self.scheduler, self.scheduler_interval, self.decay_norm_and_bias)
