"""Masked-LM pretraining from token shards on disk (``simigrad-prepare-text``), for corpora larger than memory.

:mod:`.prepare_text` tokenizes a corpus once into shard files of raw token ids and an ``index.json``; this module
memory-maps every shard and cuts it into blocks ``[CLS] t_i .. t_{i+n} [SEP]`` of ``max_seq_length`` tokens, as
:class:`~.text.MaskedTextDataModule` cuts its in-memory stream. A block never crosses from one shard into the next:
each shard's last ``len % (max_seq_length - 2)`` tokens are not served (at most one block per shard). The shards are
joined by ``ConcatDataset``, so the datasets are map-style and SimiGrad's sampler shuffles them as any other.

What stays in memory is flat in the corpus: the memory maps (pages the kernel reads in on demand and may drop
again, as page cache) and a few numbers per shard. The training blocks are masked per batch by
``DataCollatorForLanguageModeling``, as with the in-memory module. The validation blocks are masked one by one, in
``__getitem__``, with a seed drawn from ``(val_mask_seed, index)``: every run scores the same masked tokens, as
the in-memory module's masks drawn once, without holding a masked copy of the validation set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, default_collate
from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

from lightning_simigrad_recipes.data.base import TokenizedDataModule
from lightning_simigrad_recipes.data.prepare_text import FORMAT, INDEX, SPLITS
from lightning_simigrad_recipes.data.text import TokenBlocks
from lightning_simigrad_recipes.data.tokenizer import load_tokenizer
from lightning_simigrad_recipes.errors import RecipeError

PREPARE = "simigrad-prepare-text --files '/data/wiki/*.txt' --tokenizer-path /data/bert-vocab --out {path}"
HOW = "the experiment's config file gives its command, simigrad-prepare-text --help the options"


class ShardBlocks(TokenBlocks):
    """The blocks of one shard file, memory-mapped.

    Pickled (a DataLoader worker under the spawn start method, a spawned DDP process), it carries its path and
    reopens the map: a pickled ``np.memmap`` would be a copy of the whole shard.
    """

    def __init__(self, path: Path, dtype: str, tokens: int, block: int, cls_id: int, sep_id: int) -> None:
        self.path, self.dtype, self.count = path, dtype, tokens
        super().__init__(self._map(), block, cls_id, sep_id)

    def _map(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.count,))

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "tokens"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.tokens = self._map()


def mask_seed(seed: int, index: int) -> int:
    """A block's own seed: independent streams for every ``(seed, index)``, unlike ``seed + index``."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint64)[0])


class FixedMaskBlocks(Dataset[dict[str, torch.Tensor]]):
    """Blocks masked by ``collator``, each with the same masks at every read, whoever reads it.

    The collator draws from torch's default CPU generator; it is seeded per block inside ``fork_rng``, which puts
    the run's generator state back afterwards, so reading validation blocks leaves the training's randomness alone.
    """

    def __init__(self, blocks: ConcatDataset[dict[str, torch.Tensor]], collator: Any, seed: int) -> None:
        self.blocks, self.collator, self.seed = blocks, collator, seed

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.blocks[index]["input_ids"]  # a bare tensor: the collator stacks it instead of padding a dict
        with torch.random.fork_rng(devices=[]):  # the CPU generator only: the collator masks on the CPU
            torch.random.default_generator.manual_seed(mask_seed(self.seed, index))
            masked = self.collator([ids])
        return {"input_ids": masked["input_ids"][0], "labels": masked["labels"][0]}


class TokenShardsDataModule(TokenizedDataModule):
    """Token shards prepared by ``simigrad-prepare-text``, for BERT masked-LM pretraining.

    Args:
        path: the folder ``simigrad-prepare-text --out`` wrote (``index.json``, ``tokenizer/``, ``train/``,
            ``val/``). The tokenizer is the one saved there: the token ids mean nothing with another.
        max_seq_length: tokens per sequence including ``[CLS]`` and ``[SEP]``; any length up to the shortest
            useful shard, chosen at training time (phase 1 at 128 and phase 2 at 512 read the same folder).
        mlm_probability: share of tokens masked (BERT: 0.15).
        val_mask_seed: seed of the validation masks (``None``: new masks at every pass).
        **kwargs: ``batch_size``, ``num_workers``... of :class:`RecipeDataModule`.
    """

    def __init__(
        self,
        path: str | None = None,
        max_seq_length: int = 128,
        mlm_probability: float = 0.15,
        val_mask_seed: int | None = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.path = path
        self.max_seq_length = max_seq_length
        self.mlm_probability = mlm_probability
        self.val_mask_seed = val_mask_seed
        self.tokenizer: PreTrainedTokenizerFast | None = None

    def _build(self) -> None:
        folder = self._folder()
        index = self._index(folder)
        self.tokenizer = load_tokenizer(str(folder / "tokenizer"))
        blocks = {split: self._blocks(folder, index, split) for split in SPLITS}
        self.train_set = blocks["train"]
        self.collate_fn = DataCollatorForLanguageModeling(self.tokenizer, mlm_probability=self.mlm_probability)
        val_set: Dataset[dict[str, torch.Tensor]] = blocks["val"]
        if self.val_mask_seed is not None:
            val_set = FixedMaskBlocks(blocks["val"], self.collate_fn, self.val_mask_seed)
        self.val_set = val_set

    def _folder(self) -> Path:
        if not self.path:
            raise RecipeError(
                "data.path is not set: give the folder simigrad-prepare-text wrote, e.g. data.path=/data/wiki-shards,"
                f" after {PREPARE.format(path='/data/wiki-shards')} ({HOW})"
            )
        folder = Path(os.path.expanduser(self.path))
        if not (folder / INDEX).is_file():
            state = "does not exist" if not folder.exists() else f"holds no {INDEX} (no complete preparation)"
            raise RecipeError(
                f"data.path={self.path} {state}: run simigrad-prepare-text first, e.g. {PREPARE.format(path=folder)}"
                f" ({HOW})"
            )
        return folder

    def _index(self, folder: Path) -> dict[str, Any]:
        try:
            index = json.loads((folder / INDEX).read_text())
        except (OSError, ValueError) as err:
            raise RecipeError(
                f"data.path={self.path}: {INDEX} could not be read ({err}); prepare the folder again with"
                " simigrad-prepare-text --overwrite"
            ) from None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            found = index.get("format") if isinstance(index, dict) else None
            raise RecipeError(
                f"data.path={self.path}: {INDEX} has format version {found!r}, this version of the recipes reads"
                f" {FORMAT}; prepare the folder again with this version's simigrad-prepare-text --overwrite"
            )
        return index

    def _blocks(self, folder: Path, index: dict[str, Any], split: str) -> ConcatDataset[dict[str, torch.Tensor]]:
        """The split's shards as one dataset; each shard checked against the index, the too short ones left out."""
        assert self.tokenizer is not None
        dtype, block = np.dtype(index["dtype"]), self.max_seq_length - 2
        shards = index["shards"][split]
        for shard in shards:
            path, expected = folder / shard["file"], shard["tokens"] * dtype.itemsize
            found = f"holds {path.stat().st_size} bytes" if path.is_file() else "is missing"
            if not path.is_file() or path.stat().st_size != expected:
                raise RecipeError(
                    f"data.path={self.path}: {shard['file']} {found}, but {INDEX} gives it {shard['tokens']}"
                    f" {dtype.name} tokens ({expected} bytes); the folder changed after its preparation: prepare it"
                    " again with simigrad-prepare-text --overwrite"
                )
        cls_id, sep_id = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        datasets = [
            ShardBlocks(folder / s["file"], dtype.name, s["tokens"], block, cls_id, sep_id)
            for s in shards
            if s["tokens"] >= block  # np.memmap cannot map an empty file; a shorter shard gives no block anyway
        ]
        if not datasets:
            longest = max((s["tokens"] for s in shards), default=0)
            name = {"train": "training", "val": "validation"}[split]
            raise RecipeError(
                f"data.max_seq_length={self.max_seq_length} is longer than any {name} shard of data.path={self.path}"
                f" allows: the longest holds {longest} tokens, a block takes {block} and [CLS], [SEP]; lower"
                " data.max_seq_length, or prepare the corpus with fewer --workers (longer shards) or a larger"
                " --val-fraction"
            )
        return ConcatDataset(datasets)

    def val_dataloader(self) -> Any:
        loader = super().val_dataloader()
        if isinstance(self.val_set, FixedMaskBlocks):  # masked by the dataset: stack, do not mask again
            loader.collate_fn = default_collate
        return loader
