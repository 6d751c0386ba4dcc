"""What the tests of Lightning's features share: audited fits of the users' modules, and callbacks that count.

Each of those tests runs a module of :mod:`tests.support.user_modules` as its users write it, with SimiGrad added,
and asserts a property that breaks if SimiGrad mishandles the path; many also run the same setup as plain
Lightning (a fixed batch) and assert that SimiGrad keeps what Lightning does: counts, gradients, learning rates,
validations per epoch.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad
from lightning_simigrad.testing import StepAudit
from tests.support.helpers import trainer
from tests.support.user_modules import BoringModel, RandomDataset


class GradientAudit(StepAudit):
    """The reference harness, read as these tests read it: each step's samples, and its gradient's error."""

    def __init__(self, mean_loss) -> None:
        super().__init__(indices=lambda batch: batch[0].tolist(), mean_loss=mean_loss)

    @property
    def samples(self) -> list[list[int]]:
        return [step.samples for step in self.steps]

    @property
    def errors(self) -> list[float]:
        return [step.grad_rel_error for step in self.steps]


def boring_loss(dataset: RandomDataset):
    return lambda model, indices: model.loss(dataset.data[indices])


def fit_boring(cb: SimiGrad, model=None, dataset_length=128, batch_size=8, extra_callbacks=(), **trainer_kwargs):
    pl.seed_everything(0)
    dataset = RandomDataset(32, dataset_length)
    audit = GradientAudit(boring_loss(dataset))
    model = model or BoringModel()
    t = trainer(callbacks=[cb, audit, *extra_callbacks], **trainer_kwargs)
    t.fit(model, DataLoader(dataset, batch_size=batch_size, shuffle=True))
    return t, model, audit


def make_scheduler(optimizer, idiom: str, total: int):
    if idiom == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
    if idiom == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total, eta_min=1e-4)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / total))


class ScheduledBoring(BoringModel):
    """The common idioms: a step-interval schedule over `self.trainer.estimated_stepping_batches`."""

    def __init__(self, idiom: str) -> None:
        super().__init__()
        self.idiom = idiom

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = make_scheduler(optimizer, self.idiom, self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class FrequencyTwo(BoringModel):
    """A step-interval scheduler stepped every second batch (Lightning counts the batches within each epoch)."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 2}}


class AppliedLRs(pl.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.at_epoch_end: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def on_train_epoch_end(self, trainer, pl_module):
        self.at_epoch_end.append(trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0])


class StepsPerEpoch(pl.Callback):
    def __init__(self) -> None:
        self.steps: dict[int, int] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps[trainer.current_epoch] = self.steps.get(trainer.current_epoch, 0) + 1


class ValidationsPerEpoch(pl.Callback):
    def __init__(self) -> None:
        self.per_epoch: dict[int, int] = {}
        self.inside_a_window = 0

    def on_validation_start(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        self.per_epoch[trainer.current_epoch] = self.per_epoch.get(trainer.current_epoch, 0) + 1
        cb = next((c for c in trainer.callbacks if isinstance(c, SimiGrad)), None)
        if cb is not None and cb.schedule.current.inside_window:
            self.inside_a_window += 1
