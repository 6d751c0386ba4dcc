"""What users read: every step's metrics reach the loggers and `trainer.callback_metrics` (for Lightning's monitors)."""

from __future__ import annotations

import csv

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

import lightning_simigrad
from lightning_simigrad import METRICS, MeasurementError, SimiGrad
from tests.support.helpers import IndexedRegression, Regressor, trainer


class ValidatedRegressor(Regressor):
    def validation_step(self, batch, batch_idx):
        _, x, y = batch
        self.log("val_loss", self.loss(x, y))


def loaders(n=96):
    data = IndexedRegression(n)
    return DataLoader(data, batch_size=8, shuffle=True), DataLoader(data, batch_size=32)


def test_early_stopping_monitors_the_batch_size():
    pl.seed_everything(0)
    # `max_batch_size` holds the batch at 16 from the first step: no improvement for `patience` epochs
    cb = SimiGrad(target_similarity=0.99, min_batch_size=16, max_batch_size=16, initial_batch_size=16)
    stop = EarlyStopping(monitor="simigrad/batch_size", mode="max", patience=1, check_on_train_epoch_end=True)
    t = trainer(callbacks=[cb, stop], max_epochs=10, limit_val_batches=0)
    t.fit(Regressor(), loaders()[0])
    assert t.current_epoch < 10 and stop.stopped_epoch > 0  # stopped by the monitored metric, not by max_epochs
    assert float(t.callback_metrics["simigrad/batch_size"]) == 16.0


def test_model_checkpoint_keeps_the_best_similarity(tmp_path):
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.9, max_batch_size=64)
    best = ModelCheckpoint(dirpath=tmp_path, monitor="simigrad/similarity", mode="max", save_top_k=1)
    t = trainer(callbacks=[cb, best], max_epochs=3, enable_checkpointing=True)
    t.fit(ValidatedRegressor(), *loaders())
    # the checkpoint callback read the similarity of the last step before each validation
    assert best.best_model_score is not None and torch.isfinite(best.best_model_score)
    score = float(best.best_model_score)
    assert any(abs(score - row["similarity"]) < 1e-6 for row in cb.history)  # kept as float32, as Lightning does
    assert set(METRICS) <= set(t.callback_metrics)


def test_every_step_reaches_the_loggers_with_its_optimizer_step(tmp_path):
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.9, max_batch_size=64)
    t = trainer(callbacks=[cb], max_epochs=1, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    t.fit(Regressor(), loaders()[0])
    with open(next(tmp_path.rglob("metrics.csv"))) as file:
        rows = [r for r in csv.DictReader(file) if r.get("simigrad/batch_size")]
    assert [int(r["step"]) for r in rows] == list(range(len(cb.history)))
    assert [float(r["simigrad/batch_size"]) for r in rows] == [h["batch_size"] for h in cb.history]


def test_measurement_error_is_exported_where_users_import_simigrad():
    assert "MeasurementError" in lightning_simigrad.__all__ and issubclass(MeasurementError, RuntimeError)
    assert MeasurementError.__module__ == "lightning_simigrad"
