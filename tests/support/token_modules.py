"""A module written as language-model code is, for the loss-item tests: variable-length sequences padded to the
longest of their micro-batch, labels -100 on padding and on each sequence's prompt, and a ``training_step`` that
returns PyTorch's default mean over the micro-batch's labelled tokens."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

VOCAB, PAD, IGNORE = 24, 0, -100


class Sequences(Dataset):
    """Sequence ``i``: tokens of length 3..16, the first 0..4 of them a prompt (not labelled); each token's label is
    the next token, the last token's label a fixed end token."""

    def __init__(self, n: int = 120, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens, self.prompts = [], []
        for _ in range(n):
            length = int(torch.randint(3, 17, (), generator=g))
            self.tokens.append(torch.randint(1, VOCAB, (length,), generator=g))
            self.prompts.append(int(torch.randint(0, min(5, length - 1), (), generator=g)))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        tokens = self.tokens[i]
        labels = torch.cat([tokens[1:], torch.tensor([1])])
        labels[: self.prompts[i]] = IGNORE
        return {"index": i, "input_ids": tokens, "labels": labels}


def pad_collate(samples: list[dict]) -> dict:
    """Pads to the micro-batch's longest sequence, as language-model collators do."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), PAD)
    labels = torch.full((len(samples), longest), IGNORE)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])] = s["input_ids"]
        labels[row, : len(s["labels"])] = s["labels"]
    return {"index": torch.tensor([s["index"] for s in samples]), "input_ids": ids, "labels": labels}


def labelled_tokens(batch: dict) -> torch.Tensor:
    return (batch["labels"] != IGNORE).sum()


class TokenModel(pl.LightningModule):
    """A token-wise model (embedding, MLP): each token's loss depends on its own token only, so padding changes
    nothing but the count the mean divides by."""

    def __init__(self, lr: float = 0.05, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(VOCAB, 8).to(dtype)
        self.head = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, VOCAB)).to(dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"])
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))  # mean over labelled tokens

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TokenMeanLoss:
    """The reference: (sum of the token losses of the given sequences) / (their labelled tokens), unpadded."""

    def __init__(self, dataset: Sequences) -> None:
        self.dataset = dataset

    def __call__(self, model: TokenModel, indices: list[int]) -> torch.Tensor:
        samples = [self.dataset[i] for i in indices]
        ids = torch.cat([s["input_ids"] for s in samples])
        labels = torch.cat([s["labels"] for s in samples])
        return F.cross_entropy(model(ids), labels)  # every labelled token of the step weighs 1 / (their number)


def indices_of(batch: dict) -> list[int]:
    return batch["index"].tolist()
