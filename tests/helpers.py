"""Small models and data for the integration tests: every sample carries its index."""

from __future__ import annotations

import atexit
import copy
import multiprocessing
import os

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset


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


class ExitWithoutFinalization(pl.Callback):
    """In a ``ddp_spawn`` child, after a fit that returned: end the process without the interpreter's finalization.

    With torch 2.14 a gloo child left to finalize now and then aborts after its fit has finished and its results
    were sent (``terminate called without an active exception``: gloo's worker threads still hold the last
    collectives' tensors), and the launching process then raises. That is torch's, not what these tests check;
    ``atexit`` runs after Lightning has queued the child's results.
    """

    def teardown(self, trainer, pl_module, stage):
        if stage == "fit" and multiprocessing.parent_process() is not None:  # never the test process itself
            atexit.register(os._exit, 0)


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


class StepRecorder(pl.Callback):
    """After SimiGrad (later in the callback list): each step's samples, reference gradient and halves."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.steps: list[dict] = []
        self.decisions: list[int] = []  # the batch size SimiGrad asks for after each step
        self._consumed = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from lightning_simigrad import SimiGrad

        simigrad = next(c for c in trainer.callbacks if isinstance(c, SimiGrad))
        if len(self.decisions) < len(simigrad.history):
            self.decisions.append(simigrad.batch_size)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        micro = pl_module.micro_batches[self._consumed :]
        self._consumed = len(pl_module.micro_batches)
        indices = [i for m in micro for i in m]
        grads = [p.grad.detach().clone() for p in pl_module.parameters()]
        reference = self._gradient(pl_module, indices)
        half = len(micro) // 2
        g_a = self._gradient(pl_module, [i for m in micro[:half] for i in m]) if half else None
        g_b = self._gradient(pl_module, [i for m in micro[half:] for i in m]) if half else None
        self.steps.append(dict(micro=micro, indices=indices, grads=grads, reference=reference, g_a=g_a, g_b=g_b))

    def _gradient(self, pl_module, indices):
        model = copy.deepcopy(pl_module)
        model.zero_grad()
        x, y = self.dataset.x[indices], self.dataset.y[indices]
        model.loss(x, y).backward()  # the mean loss over exactly these samples
        return [p.grad for p in model.parameters()]


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
