"""Masked-LM pretraining text: local files (a glob) or CPython's bundled ``pydoc_data.topics``.

The corpus is tokenized once at startup into one token stream and cut into blocks of
``max_seq_length`` tokens (``[CLS] ... [SEP]``), as BERT's sequence-length-128 phase does; 15% of
the tokens are masked per batch by ``transformers.DataCollatorForLanguageModeling``. Everything is
held in memory (int32 token ids): for a Wikipedia-sized corpus give a subset of the files or
pre-tokenize it yourself.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

from lightning_simigrad_recipes.data.base import RecipeDataModule
from lightning_simigrad_recipes.data.tokenizer import build_tokenizer
from lightning_simigrad_recipes.errors import RecipeError


def expand_files(files: str | list[str] | None) -> list[Path]:
    """Expand ``data.files`` (one glob, or a list of globs/paths) into existing files."""
    if not files:
        raise RecipeError("data.files is not set: give the text corpus, e.g. data.files='/data/wiki/*.txt'")
    patterns = [files] if isinstance(files, str) else list(files)
    found = sorted({Path(p) for pat in patterns for p in glob.glob(os.path.expanduser(pat), recursive=True)})
    found = [p for p in found if p.is_file()]
    if not found:
        raise RecipeError(
            f"data.files={patterns if len(patterns) > 1 else patterns[0]!r} matched no files; "
            "give a glob of UTF-8 text files, quoted, e.g. data.files='/data/wiki/*.txt'"
        )
    return found


class TokenBlocks(Dataset[dict[str, torch.Tensor]]):
    """Blocks ``[CLS] t_i .. t_{i+n} [SEP]`` cut from one token stream."""

    def __init__(self, tokens: np.ndarray, block: int, cls_id: int, sep_id: int) -> None:
        self.tokens, self.block, self.cls_id, self.sep_id = tokens, block, cls_id, sep_id

    def __len__(self) -> int:
        return len(self.tokens) // self.block

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        body = self.tokens[index * self.block : (index + 1) * self.block]
        ids = np.concatenate([[self.cls_id], body, [self.sep_id]]).astype(np.int64)
        return {"input_ids": torch.from_numpy(ids)}


class MaskedTextDataModule(RecipeDataModule):
    """Text corpus for BERT masked-LM pretraining.

    Args:
        files: a glob (or list of globs) of text files; ignored when ``source="pydoc"``.
        source: ``"files"`` or ``"pydoc"`` (CPython's ``pydoc_data.topics``, always present).
        tokenizer: the ``tokenizer`` config: ``path`` (local vocab.txt folder or tokenizer.json),
            ``train`` (train WordPiece on the corpus when no path), ``vocab_size``, ``lowercase``.
        max_seq_length: tokens per sequence including ``[CLS]`` and ``[SEP]``.
        mlm_probability: share of tokens masked (BERT: 0.15).
        val_fraction: share of the blocks held out for validation (at least one block).
        **kwargs: ``batch_size``, ``num_workers``... of :class:`RecipeDataModule`.
    """

    def __init__(
        self,
        files: str | list[str] | None = None,
        source: str = "files",
        tokenizer: Any = None,
        max_seq_length: int = 128,
        mlm_probability: float = 0.15,
        val_fraction: float = 0.01,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if source not in ("files", "pydoc"):
            raise RecipeError(f"data.source={source!r} is unknown; use 'files' or 'pydoc'")
        self.files, self.source = files, source
        self.tokenizer_cfg = dict(tokenizer or {})
        self.max_seq_length = max_seq_length
        self.mlm_probability = mlm_probability
        self.val_fraction = val_fraction
        self.output_dir: Path = Path(".")
        self.tokenizer: PreTrainedTokenizerFast | None = None

    def _lines(self) -> Iterator[str]:
        if self.source == "pydoc":
            from pydoc_data.topics import topics

            for text in topics.values():
                yield from text.splitlines()
            return
        for path in self._paths:
            with path.open(encoding="utf-8", errors="replace") as f:
                yield from f

    def _build(self) -> None:
        self._paths = expand_files(self.files) if self.source == "files" else []
        cfg = self.tokenizer_cfg
        self.tokenizer = build_tokenizer(
            path=cfg.get("path"),
            train=bool(cfg.get("train", False)),
            vocab_size=int(cfg.get("vocab_size", 30522)),
            lowercase=bool(cfg.get("lowercase", True)),
            texts=self._lines(),
            save_dir=self.output_dir / "tokenizer",
        )
        chunks, batch = [], []
        for line in self._lines():
            if line.strip():
                batch.append(line)
            if len(batch) == 2048:
                chunks.extend(self._encode(batch))
                batch = []
        chunks.extend(self._encode(batch))
        tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
        block = self.max_seq_length - 2
        n_blocks = len(tokens) // block
        if n_blocks < 2:
            where = "pydoc_data.topics" if self.source == "pydoc" else f"data.files={self.files!r}"
            raise RecipeError(
                f"{where} gives {len(tokens)} tokens, fewer than two blocks of {self.max_seq_length}; "
                "add text or lower data.max_seq_length"
            )
        n_val = max(1, int(n_blocks * self.val_fraction))
        split = (n_blocks - n_val) * block
        cls_id, sep_id = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        self.train_set = TokenBlocks(tokens[:split], block, cls_id, sep_id)
        self.val_set = TokenBlocks(tokens[split : n_blocks * block], block, cls_id, sep_id)
        self.collate_fn = DataCollatorForLanguageModeling(self.tokenizer, mlm_probability=self.mlm_probability)

    def _encode(self, lines: list[str]) -> list[np.ndarray]:
        if not lines:
            return []
        assert self.tokenizer is not None
        ids = self.tokenizer(lines, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        return [np.asarray(x, dtype=np.int32) for x in ids if x]

    def model_kwargs(self) -> dict[str, Any]:
        self.check_inputs()
        assert self.tokenizer is not None
        return {"vocab_size": len(self.tokenizer), "pad_token_id": self.tokenizer.pad_token_id}
