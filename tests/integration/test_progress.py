"""Lightning's step counts served in samples: `estimated_stepping_batches` in B0-steps, for one Trainer, one fit."""

from __future__ import annotations

import math

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad
from tests.support.helpers import IndexedRegression, Regressor, trainer


class ReadEstimate(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.during = (type(trainer), trainer.estimated_stepping_batches)


def test_the_estimate_counts_b0_steps_on_this_trainer_during_its_fit_only():
    pl.seed_everything(0)
    read = ReadEstimate()
    t = trainer(callbacks=[SimiGrad(target_similarity=0.9, initial_batch_size=16), read], max_epochs=3)
    other = trainer(max_epochs=3)
    t.fit(Regressor(), DataLoader(IndexedRegression(100), batch_size=8, shuffle=True))
    kind, estimate = read.during
    assert kind is not pl.Trainer and issubclass(kind, pl.Trainer)  # a subclass for this Trainer's fit
    assert type(other) is pl.Trainer  # other Trainers are left alone
    assert estimate == 3 * math.ceil(100 / 16)  # steps of B0 = 16 samples, not of the loader's 8
    assert type(t) is pl.Trainer  # given back after the fit


def test_with_schedules_by_optimizer_step_the_trainer_keeps_its_class():
    read = ReadEstimate()
    t = trainer(callbacks=[SimiGrad(target_similarity=0.9, schedule_by_samples=False), read], max_epochs=1)
    t.fit(Regressor(), DataLoader(IndexedRegression(64), batch_size=8))
    assert read.during[0] is pl.Trainer
