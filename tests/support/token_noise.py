"""A problem whose noise scale is known exactly, in tokens: the token analogue of ``known_noise_dataset``.

Sample ``i`` is a sequence of ``n_i`` tokens (``n_i`` uniform in ``1..max_length``); token ``t`` of it carries a
vector ``v_t = G + sigma xi_t + sigma_s eta_i`` (``xi_t`` independent across tokens, ``eta_i`` one draw shared by
all tokens of sequence ``i``, both standard normal in ``d`` dimensions, ``|G| = 1``). A micro-batch's loss is the
mean over its (unpadded) tokens of ``w . v_t``, so each token's gradient is ``v_t`` whatever ``w`` is, and a step's
gradient is the mean of its tokens' vectors.

A step of whole sequences holding ``T`` tokens has gradient ``sum_i S_i / sum_i n_i`` (``S_i`` the sum of sequence
``i``'s token vectors), whose noise is ``sum_i |S_i - n_i G|^2 / T^2``. With
``E|S_i - n_i G|^2 = d sigma^2 n_i + d sigma_s^2 n_i^2``, that is ``B_tok |G|^2 / T`` on average, with the
effective per-token noise scale

    B_tok = E|S_i - n_i G|^2 / (nbar |G|^2) = d (sigma^2 + sigma_s^2 E[n^2] / E[n]),

``nbar = E[n]``: ``d sigma^2`` (the naive per-token one) only where the tokens are independent (``sigma_s = 0``).
The halves' similarity at ``T / 2`` tokens each is ``1 / (1 + 2 B_tok / T)``, so a target ``tau`` is met at
``B* = 2 B_tok tau / (1 - tau)`` tokens.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset


def length_moments(max_length: int) -> tuple[float, float]:
    """``E[n]`` and ``E[n^2]`` of a length uniform in ``1..max_length``."""
    m = max_length
    return (m + 1) / 2, (m + 1) * (2 * m + 1) / 6


def token_noise_scale(dim: int, sigma: float, shared: float, max_length: int) -> float:
    """The effective per-token noise scale ``d (sigma^2 + sigma_s^2 E[n^2] / E[n])`` (``|G| = 1``)."""
    mean, mean_sq = length_moments(max_length)
    return dim * (sigma**2 + shared**2 * mean_sq / mean)


class TokenNoise(Dataset):
    """``n`` sequences of ``1..max_length`` tokens, each token a ``dim``-vector ``G + sigma xi_t + shared eta_i``.

    Item ``i`` is ``(i, its n_i x dim vectors)``; :func:`pad_tokens` collates a micro-batch.
    """

    def __init__(
        self, n: int, dim: int, sigma: float, shared: float = 0.0, max_length: int = 40, seed: int = 0
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(1, max_length + 1, (n,), generator=g)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), self.lengths.cumsum(0)])
        total = int(self.offsets[-1])
        G = torch.zeros(dim)
        G[0] = 1.0
        per_sequence = shared * torch.randn(n, dim, generator=g)
        self.vectors = G + sigma * torch.randn(total, dim, generator=g)
        self.vectors += per_sequence.repeat_interleave(self.lengths, dim=0)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, self.vectors[self.offsets[i] : self.offsets[i + 1]]


def pad_tokens(samples: list[tuple[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pads a micro-batch to its longest sequence: ``vectors`` (m x L x d), ``mask`` (m x L), ``index`` (m)."""
    longest = max(len(v) for _, v in samples)
    dim = samples[0][1].shape[1]
    vectors = torch.zeros(len(samples), longest, dim)
    mask = torch.zeros(len(samples), longest, dtype=torch.bool)
    for row, (_, v) in enumerate(samples):
        vectors[row, : len(v)] = v
        mask[row, : len(v)] = True
    return {"index": torch.tensor([i for i, _ in samples]), "vectors": vectors, "mask": mask}


def token_count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss items of a micro-batch: its unpadded tokens."""
    return batch["mask"].sum()


class TokenLinearLoss(pl.LightningModule):
    """The mean over a micro-batch's tokens of ``w . v_t``: each token's gradient is ``v_t``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(dim))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        per_token = batch["vectors"] @ self.w
        mask = batch["mask"]
        return (per_token * mask).sum() / mask.sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the gradients do not depend on w anyway


class StepTokens(pl.Callback):
    """Every optimizer step's samples, from the micro-batches the module trains (place it after ``simigrad``; a
    zero-weight padding sample is no sample of the step)."""

    def __init__(self, simigrad) -> None:
        self.simigrad = simigrad
        self.steps: list[list[int]] = []
        self._window: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.simigrad.run.local_samples:
            self._window.extend(batch["index"].tolist())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps.append(self._window)
        self._window = []
