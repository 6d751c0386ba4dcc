"""Accumulation windows of any length inside Lightning's loop, with no SimiGrad: boundaries, zero_grad, loss scale."""

from __future__ import annotations

import itertools

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_simigrad.integration.accumulation import VariableAccumulation
from tests.support.helpers import IndexedRegression, Regressor, trainer

LENGTHS = [4, 3, 5, 2, 2, 6]  # what Lightning's own `accumulate_grad_batches` cannot do mid-epoch


class Windows(pl.Callback):
    """Declares each micro-batch's window, and records where the optimizer stepped and with which gradient."""

    def __init__(self) -> None:
        self.accumulation = VariableAccumulation()
        ends = list(itertools.accumulate(LENGTHS))
        self.plan = [
            (length, i == end - length, i == end - 1)
            for end, length in zip(ends, LENGTHS)
            for i in range(end - length, end)
        ]
        self.stepped_at: list[int] = []
        self.grads: list[torch.Tensor] = []
        self.window_lengths: list[int] = []

    def on_fit_start(self, trainer, pl_module):
        self.accumulation.attach(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        length, start, end = self.plan[batch_idx]
        self.accumulation.set_micro_batch(start, end, loss_divisor=length, window_length=length)
        self.window_lengths.append(trainer.accumulate_grad_batches)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.stepped_at.append(len(pl_module.micro_batches) - 1)
        self.grads.append(torch.cat([p.grad.reshape(-1) for p in pl_module.parameters()]).clone())

    def teardown(self, trainer, pl_module, stage):
        self.accumulation.detach()


def test_windows_of_any_length_step_where_they_end_on_the_mean_over_their_micro_batches():
    pl.seed_everything(0)
    data = IndexedRegression(sum(LENGTHS) * 4)
    windows, model = Windows(), Regressor(lr=0.0)  # lr 0: every window sees the same weights
    t = trainer(callbacks=[windows], max_epochs=1, accumulate_grad_batches=3)
    t.fit(model, DataLoader(data, batch_size=4))
    assert windows.stepped_at == [end - 1 for end in itertools.accumulate(LENGTHS)]
    assert windows.window_lengths == [length for length in LENGTHS for _ in range(length)]
    assert t.accumulate_grad_batches == 3  # the user's setting is back after the fit
    start = 0
    for length, grad in zip(LENGTHS, windows.grads):
        indices = list(range(4 * start, 4 * (start + length)))
        reference = Regressor(lr=0.0)
        reference.load_state_dict(model.state_dict())
        reference.loss(data.x[indices], data.y[indices]).backward()  # the mean over the window's samples
        expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        assert torch.allclose(grad, expected, rtol=1e-10, atol=1e-12)  # nothing of the window before leaked in
        start += length
