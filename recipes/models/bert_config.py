"""The ``transformers.BertConfig`` of the BERT recipes' modules, checked against the data's sequence length."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import BertConfig

from lightning_simigrad_recipes.errors import RecipeError


def bert_config(
    config: Mapping[str, Any], vocab_size: int, pad_token_id: int, max_seq_length: int | None = None
) -> BertConfig:
    """``model.config`` with the tokenizer's vocabulary; ``max_seq_length`` (the data's) must fit its positions.

    A sequence longer than ``max_position_embeddings`` would otherwise fail deep in the first forward pass with an
    index error (phase 2's 512 tokens on a model built with 128 positions, say).
    """
    built = BertConfig(**dict(config), vocab_size=vocab_size, pad_token_id=pad_token_id)
    if max_seq_length is not None and max_seq_length > built.max_position_embeddings:
        raise RecipeError(
            f"data.max_seq_length={max_seq_length} exceeds model.config.max_position_embeddings="
            f"{built.max_position_embeddings}; lower data.max_seq_length or raise model.config.max_position_embeddings"
            " (to continue from a checkpoint, it must equal that run's)"
        )
    return built
