"""Small models and data for the integration tests: every sample carries its index."""

from __future__ import annotations

import atexit
import multiprocessing
import os

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from lightning_simigrad.testing import StepAudit


class IndexedRegression(Dataset):
    """Noisy linear regression; item ``i`` is ``(i, x_i, y_i)``."""

    def __init__(self, n: int = 300, dim: int = 6, seed: int = 0, dtype: torch.dtype = torch.float64) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g, dtype=dtype)
        self.y = self.x @ torch.randn(dim, 1, generator=g, dtype=dtype) + 0.5 * torch.randn(
            n, 1, generator=g, dtype=dtype
        )

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


class Regressor(pl.LightningModule):
    """A small MLP returning the mean squared error; records the indices of every micro-batch it trains on.

    With ``dropout`` its training step draws random numbers, so its gradients depend on the RNG's state.
    """

    def __init__(
        self,
        dim: int = 6,
        lr: float = 0.05,
        dtype: torch.dtype = torch.float64,
        scheduler: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        hidden = [nn.Linear(dim, 8), nn.Tanh()] + ([nn.Dropout(dropout)] if dropout else [])
        self.net = nn.Sequential(*hidden, nn.Linear(8, 1)).to(dtype)
        self.lr = lr
        self.use_scheduler = scheduler
        self.micro_batches: list[list[int]] = []

    def loss(self, x, y):
        return nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        self.micro_batches.append(idx.tolist())
        return self.loss(x, y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if not self.use_scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def exit_without_finalization() -> None:
    """In a spawned child (Lightning's or Fabric's ``ddp_spawn``): end the process, once it is done, without the
    interpreter's finalization.

    With torch 2.14 a gloo child left to finalize now and then aborts after its work has finished and its results
    were sent (``terminate called without an active exception``: gloo's worker threads still hold the last
    collectives' tensors; destroying the process group first does not prevent it), and the launching process then
    raises. That is torch's, not what these tests check; ``atexit`` runs after the launcher has queued the child's
    results.
    """
    if multiprocessing.parent_process() is not None:  # never the test process itself
        atexit.register(os._exit, 0)


class ExitWithoutFinalization(pl.Callback):
    """:func:`exit_without_finalization` after a fit that returned."""

    def teardown(self, trainer, pl_module, stage):
        if stage == "fit":
            exit_without_finalization()


def trainer(**kwargs) -> pl.Trainer:
    if kwargs.get("strategy") == "ddp_spawn":
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), ExitWithoutFinalization()]
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return pl.Trainer(**(defaults | kwargs))


def step_audit(dataset) -> StepAudit:
    """The reference harness for a :class:`Regressor` fit on ``dataset`` (place it after SimiGrad): every step's
    samples, micro-batches, gradient error against the mean over exactly its samples, and reference halves."""
    return StepAudit(indices=batch_indices, mean_loss=RegressionLoss(dataset))


def batch_indices(batch) -> list[int]:
    """The dataset indices of an :class:`IndexedRegression` batch."""
    return batch[0].tolist()


class RegressionLoss:
    """The mean loss of a :class:`Regressor` over given samples of a dataset."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __call__(self, model, indices):
        return model.loss(self.dataset.x[indices], self.dataset.y[indices])


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


# A problem whose noise scale is known exactly (see test_equilibrium.py): sample i carries v_i = G + sigma xi_i
# and its loss is w . v_i, so its gradient is v_i whatever w is; |G|^2 = 1 and B_noise = d sigma^2.
DIM, NOISE_SCALE, SAMPLES = 128, 25.0, 16_000


def known_noise_dataset(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    G = torch.zeros(DIM)
    G[0] = 1.0
    sigma = (NOISE_SCALE / DIM) ** 0.5
    return TensorDataset(G + sigma * torch.randn(SAMPLES, DIM, generator=g))


class LinearLoss(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(DIM))

    def training_step(self, batch, batch_idx):
        (v,) = batch
        return (v @ self.w).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the gradients do not depend on w anyway


def benchmark_module(name: str):
    """``benchmarks/<name>.py`` imported as the module ``name`` (the benchmarks are scripts, not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class StepSamples(pl.Callback):
    """After SimiGrad: the samples every optimizer step averaged (the micro-batches since the previous step), read
    from a module that records them (``Regressor.micro_batches``)."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []
        self._consumed = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        micro = pl_module.micro_batches[self._consumed :]
        self._consumed = len(pl_module.micro_batches)
        self.steps.append(sorted(i for m in micro for i in m))
