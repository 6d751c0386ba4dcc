"""Extractive question answering (SQuAD) LightningModule: ``transformers.BertForQuestionAnswering`` from a config.

The encoder can start from a masked-LM pretraining run of this package (``model.init_from``, phase 1's or phase 2's
``.ckpt``; ``recipes/models/pretrained.py``): its ``bert.bert.*`` tensors (the ``BertModel`` inside
``BertForMaskedLM``) are copied into the QA model's ``bert.*``; the masked-LM head (``bert.cls.*``) is dropped and
the span head (``qa_outputs``) starts fresh.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from transformers import BertForQuestionAnswering

from lightning_simigrad_recipes.errors import RecipeError
from lightning_simigrad_recipes.models.bert_config import bert_config
from lightning_simigrad_recipes.models.common import OptimizerFactory, SchedulerFactory, configure
from lightning_simigrad_recipes.models.pretrained import load_pretrained


class QuestionAnswering(pl.LightningModule):
    """Fine-tune BERT for SQuAD: start and end logits per token, the mean of their two cross-entropies as the loss.

    Logs ``train/loss``, ``val/loss`` and, at the end of each validation, ``val/exact_match`` and ``val/f1`` (the
    official SQuAD v1.1 scores x100, computed by the DataModule's ``evaluate`` from the start and end logits of every
    dev window), which it also prints.

    Args:
        config: ``transformers.BertConfig`` fields (hidden size, layers, heads...).
        vocab_size: size of the tokenizer's vocabulary (given by the DataModule).
        pad_token_id: the tokenizer's ``[PAD]`` id (given by the DataModule).
        optimizer: a partial optimizer (``conf/optimizer``), called with the parameter groups.
        scheduler: a partial LR scheduler or ``None``.
        scheduler_interval: ``"step"`` or ``"epoch"``.
        decay_norm_and_bias: apply weight decay to biases and LayerNorm weights too (BERT: no).
        init_from: a masked-LM pretraining checkpoint whose encoder starts the model (``None``: random init).
        max_seq_length: the DataModule's window length, checked against ``max_position_embeddings``.
        n_best_size: start and end candidates per window when picking the answer.
        max_answer_length: the longest answer, in tokens.
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
        n_best_size: int = 20,
        max_answer_length: int = 30,
    ) -> None:
        super().__init__()
        for key, value in (("n_best_size", n_best_size), ("max_answer_length", max_answer_length)):
            if value < 1:
                raise RecipeError(f"model.{key}={value} leaves no answer to pick; give at least 1 (SQuAD's: 20, 30)")
        self.bert = BertForQuestionAnswering(bert_config(config, vocab_size, pad_token_id, max_seq_length))
        # the encoder only: the span head has no counterpart in a masked-LM checkpoint
        self.init_report = load_pretrained(self.bert, init_from, parts=("bert",)) if init_from else None
        self.optimizer, self.scheduler = optimizer, scheduler
        self.scheduler_interval = scheduler_interval
        self.decay_norm_and_bias = decay_norm_and_bias
        self.n_best_size, self.max_answer_length = n_best_size, max_answer_length
        self.scores: dict[str, float] = {}  # the last validation's exact_match, f1, questions
        self._val_outputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        start_positions: torch.Tensor | None = None,
        end_positions: torch.Tensor | None = None,
    ) -> Any:
        """``BertForQuestionAnswering``'s output: ``start_logits``, ``end_logits`` and, given positions, ``loss``."""
        return self.bert(
            input_ids=input_ids,
            token_type_ids=token_type_ids,
            attention_mask=attention_mask,
            start_positions=start_positions,
            end_positions=end_positions,
        )

    @staticmethod
    def _inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in batch.items() if k != "feature_index"}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(**self._inputs(batch)).loss  # (CE(start) + CE(end)) / 2, averaged over the batch
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["input_ids"]))
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_outputs = []

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self(**self._inputs(batch))
        self.log("val/loss", out.loss, prog_bar=True, sync_dist=True, batch_size=len(batch["input_ids"]))
        if "feature_index" in batch:
            self._val_outputs.append(
                (batch["feature_index"], out.start_logits.detach().float(), out.end_logits.detach().float())
            )

    def on_validation_epoch_end(self) -> None:
        evaluate = getattr(self.trainer.datamodule, "evaluate", None) if self._trainer is not None else None
        if not self._val_outputs or evaluate is None:
            return
        index, start, end = (torch.cat(parts) for parts in zip(*self._val_outputs))
        self._val_outputs = []
        if self.trainer.world_size > 1:  # every rank scores every window (the ranks' shares are equal in size)
            index = self.all_gather(index).reshape(-1)
            start = self.all_gather(start).reshape(-1, start.shape[-1])
            end = self.all_gather(end).reshape(-1, end.shape[-1])
        self.scores = evaluate(
            index.cpu().numpy(),
            start.cpu().numpy(),
            end.cpu().numpy(),
            n_best_size=self.n_best_size,
            max_answer_length=self.max_answer_length,
        )
        # the same numbers on every rank (computed from the gathered logits): their mean is themselves
        self.log("val/exact_match", self.scores["exact_match"], prog_bar=True, sync_dist=True)
        self.log("val/f1", self.scores["f1"], prog_bar=True, sync_dist=True)
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            n, total = int(self.scores["questions"]), int(self.scores["total_questions"])
            share = "" if n == total else f" (the {n} of {total} dev questions whose windows were all scored)"
            print(f"\nSQuAD v1.1 dev: exact match {self.scores['exact_match']:.2f}, F1 {self.scores['f1']:.2f}{share}")

    def configure_optimizers(self) -> Any:
        return configure(self, self.optimizer, self.scheduler, self.scheduler_interval, self.decay_norm_and_bias)
