"""What Lightning's loggers and monitoring callbacks see with SimiGrad added: the learning rate applied, each
micro-batch's own loss in ``outputs``, no loss spike on a smooth run, and a step that could not be measured.
"""

from __future__ import annotations

import csv
import math

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad
from tests.support.helpers import IndexedRegression, Regressor, trainer
from tests.support.lightning_features import fit_boring
from tests.support.user_modules import BoringModel, ImagesDataModule, LitClassifier, TransformerStyle


def test_learning_rate_monitor_reports_the_applied_learning_rate(tmp_path):
    pl.seed_everything(0)
    model = TransformerStyle()
    cb = SimiGrad(target_similarity=0.95)
    t = trainer(
        callbacks=[LearningRateMonitor(logging_interval="step"), cb],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        max_epochs=2,
    )
    t.fit(model)
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    monitored = {int(r["step"]): float(r["lr-AdamW"]) for r in rows if r.get("lr-AdamW")}
    applied = {int(h["step"]): h["lr"] for h in cb.history}
    assert len(monitored) == t.global_step
    assert any(h["lr_scale"] > 1.5 for h in cb.history)
    for step, lr in monitored.items():
        assert lr == pytest.approx(applied[step], rel=1e-6)


class LossRecording(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.losses.append(float(out["loss"]))
        return out


class OutputsLoss(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_outputs_loss_is_the_micro_batchs_own_mean_loss():
    probe = OutputsLoss()
    cb = SimiGrad(target_similarity=0.95, max_micro_batch_size=8)
    t, model, audit = fit_boring(cb, model=LossRecording(), max_epochs=3, extra_callbacks=[probe])
    assert len({int(h["accumulation"]) for h in cb.history}) > 1  # windows of several lengths
    # what plain Lightning hands callbacks without accumulation: the loss training_step returned
    assert probe.losses == pytest.approx(model.losses, rel=1e-6)
    assert max(audit.errors) < 1e-5  # while the backward still weighs every sample of a step by 1 / batch size


def test_spike_detection_sees_no_spike_on_a_smooth_run(tmp_path):
    from lightning.pytorch.callbacks.spike import SpikeDetection

    def run(simigrad: bool):
        pl.seed_everything(0)
        datamodule = ImagesDataModule(n=256, batch_size=16)
        spikes = SpikeDetection(exclude_batches_path=tmp_path / f"skip{simigrad}.json")
        callbacks = [SimiGrad(target_similarity=0.9), spikes] if simigrad else [spikes]
        t = trainer(callbacks=callbacks, max_epochs=4)
        t.fit(LitClassifier(), datamodule=datamodule)
        return t

    assert run(simigrad=False).current_epoch == 4
    assert run(simigrad=True).current_epoch == 4  # no TrainingSpikeException


class FlatLoss(Regressor):
    """A loss with no gradient: nothing to measure the halves by."""

    def loss(self, x, y):
        return 0.0 * super().loss(x, y)


def test_a_step_that_could_not_be_measured_is_said_once_and_logged_as_nan():
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.5, initial_batch_size=8)
    with pytest.warns(UserWarning, match=r"could not measure optimizer step 0: its window held 8 samples") as caught:
        trainer(callbacks=[cb], max_epochs=1).fit(FlatLoss(), DataLoader(IndexedRegression(64), batch_size=4))
    assert sum("could not measure" in str(w.message) for w in caught) == 1
    assert len(cb.history) == 8 and all(math.isnan(row["similarity"]) for row in cb.history)
    assert {row["batch_size"] for row in cb.history} == {8}  # held
