"""What the recipes' DataModules share: plain DataLoaders over a train and a val dataset."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset


class RecipeDataModule(pl.LightningDataModule):
    """Base class: subclasses build ``self.train_set`` / ``self.val_set`` in ``_build()``.

    Args:
        batch_size: the per-device micro-batch. SimiGrad keeps it as the largest micro-batch unless
            ``simigrad.max_micro_batch_size`` says otherwise, and accumulates to reach the planned batch.
        val_batch_size: batch size of the validation loader (``None``: twice ``batch_size``).
        num_workers: DataLoader worker processes (0 loads in the main process).
        pin_memory: pin host memory when training on a GPU.
        drop_last: drop the tail of each training epoch when it is smaller than the window SimiGrad
            plans (otherwise the epoch's last step averages what is left, a smaller batch).
    """

    collate_fn: Callable[[list[Any]], Any] | None = None

    def __init__(
        self,
        batch_size: int = 32,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or 2 * batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.drop_last = drop_last
        self.train_set: Dataset[Any] | None = None
        self.val_set: Dataset[Any] | None = None

    # -- to override -----------------------------------------------------------------------------
    def _build(self) -> None:
        """Create ``self.train_set`` and ``self.val_set`` (raise ``RecipeError`` on bad input)."""
        raise NotImplementedError

    def model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments the model needs from the data (e.g. ``vocab_size``)."""
        return {}

    # -- shared ----------------------------------------------------------------------------------
    def check_inputs(self) -> None:
        """Build the datasets now, so that a wrong path stops the run before the Trainer starts."""
        if self.train_set is None:
            self._build()

    def setup(self, stage: str) -> None:
        self.check_inputs()

    def _loader(
        self, dataset: Dataset[Any] | None, batch_size: int, shuffle: bool, drop_last: bool = False
    ) -> DataLoader[Any]:
        assert dataset is not None, "check_inputs() builds the datasets before the loaders"
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            collate_fn=self.collate_fn,
        )

    def train_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.train_set, self.batch_size, shuffle=True, drop_last=self.drop_last)

    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.val_set, self.val_batch_size, shuffle=False)


class TokenizedDataModule(RecipeDataModule):
    """A DataModule of token ids whose model takes its vocabulary, padding id and longest sequence from the data."""

    tokenizer: Any = None  # set by ``_build()``: a ``transformers`` fast tokenizer
    max_seq_length: int

    def model_kwargs(self) -> dict[str, Any]:
        self.check_inputs()
        assert self.tokenizer is not None
        return {
            "vocab_size": len(self.tokenizer),
            "pad_token_id": self.tokenizer.pad_token_id,
            "max_seq_length": self.max_seq_length,
        }
