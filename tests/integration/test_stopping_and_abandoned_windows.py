"""Fits that stop, skip or abandon part of a window, with SimiGrad added: early stopping, a stop inside a window
(a callback, ``max_time``), micro-batches ``training_step`` skips, and an epoch ended early (``-1`` from
``on_train_batch_start``, ``StopIteration``), where the abandoned window is dropped as plain Lightning drops it.
"""

from __future__ import annotations

import copy
import math
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad
from tests.support.helpers import flat, trainer
from tests.support.lightning_features import GradientAudit, boring_loss, fit_boring
from tests.support.user_modules import BoringModel, ImagesDataModule, LitClassifier, RandomDataset


def test_early_stopping_stops_on_a_whole_window():
    pl.seed_everything(0)
    datamodule = ImagesDataModule(n=256, batch_size=16)
    model = LitClassifier(lr=0.05)
    images = IndexedImagesOf(datamodule)
    audit = GradientAudit(images.mean_loss)
    cb = SimiGrad(target_similarity=0.9)
    stop = EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)  # stops at the second check
    t = trainer(callbacks=[cb, audit, stop], max_epochs=20, val_check_interval=5)
    t.fit(model, datamodule=datamodule)
    assert t.should_stop
    # stopped within the first epoch at the second validation: after the step that crossed 2 x 5 batches of 16
    assert sum(map(len, audit.samples)) == cb.samples_seen
    assert 160 <= cb.samples_seen < 160 + cb.history[-1]["batch_size"] < len(datamodule.train_set)
    assert len(model.validated) == 2 * len(datamodule.val_set)
    assert max(audit.errors) < 1e-5


class IndexedImagesOf:
    def __init__(self, datamodule: ImagesDataModule) -> None:
        datamodule.setup("fit")
        self.dataset = datamodule.train_set.dataset

    def mean_loss(self, model, indices):
        return F.cross_entropy(model(self.dataset.images[indices]), self.dataset.labels[indices])


@pytest.mark.parametrize("stop", ["callback", "max_time"])
def test_a_stop_inside_a_window_leaves_the_gradient_whole(stop):
    class StopMidWindow(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 5:  # the 2nd micro-batch of the second window of 4
                trainer.should_stop = True

    pl.seed_everything(0)
    dataset = RandomDataset(32, 128)
    model = BoringModel()
    cb = SimiGrad(target_similarity=0.95, initial_batch_size=32, adjust=False)
    # max_time of a microsecond: Lightning's Timer stops the fit at the end of the first micro-batch
    flags = (
        dict(callbacks=[cb, StopMidWindow()])
        if stop == "callback"
        else dict(callbacks=[cb], max_time=timedelta(microseconds=1))
    )
    t = trainer(max_epochs=3, **flags)
    t.fit(model, DataLoader(dataset, batch_size=8, shuffle=True))
    fed = 6 if stop == "callback" else 1
    assert t.global_step == fed // 4 and cb.samples_seen == 32 * (fed // 4)
    # the unstepped window's micro-batches are whole in p.grad: (1/32) * the sum of their gradients
    unstepped = [i for m in model.micro_batches[4 * (fed // 4) : fed] for i in m]
    reference = copy.deepcopy(model)
    reference.zero_grad()
    (reference.loss(dataset.data[unstepped]) * len(unstepped) / 32).backward()
    grads, expected = flat([p.grad for p in model.parameters()]), flat([p.grad for p in reference.parameters()])
    torch.testing.assert_close(grads, expected)


class SkippingBoring(BoringModel):
    """Returns None (Lightning's documented skip) for some micro-batches."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.skip = skip
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        if self.calls - 1 in self.skip:
            return None
        return super().training_step(batch, batch_idx)


def test_skipped_micro_batches_leave_every_step_a_mean_over_what_it_fed():
    # windows of 4 micro-batches: skip a first-half one, the set-aside point, and a window's last one
    model = SkippingBoring(skip={1, 5, 11, 12, 13})
    cb = SimiGrad(target_similarity=0.95, initial_batch_size=32, adjust=False)
    t, model, audit = fit_boring(cb, model=model, max_epochs=1)
    fed = [len(s) for s in audit.samples]
    assert [int(h["batch_size"]) for h in cb.history] == fed == [24, 24, 24, 16]
    assert max(audit.errors) < 1e-5  # nothing of a skipped window leaks into the next
    assert cb.samples_seen == 128 - 5 * 8
    measured = [math.isfinite(h["similarity"]) for h in cb.history]
    assert measured == [True, True, False, False]  # no last backward, or no first half: not measured


class AbandonsTheEpoch(BoringModel):
    """Ends epoch 0 at micro-batch ``at`` in one of the ways Lightning ends an epoch early."""

    def __init__(self, how: str, at: int) -> None:
        super().__init__()
        self.how, self.at = how, at

    def on_train_batch_start(self, batch, batch_idx):
        if self.how == "return -1" and self.current_epoch == 0 and batch_idx == self.at:
            return -1  # Lightning's documented "skip the rest of the epoch"
        return None

    def training_step(self, batch, batch_idx):
        if self.how == "StopIteration in training_step" and self.current_epoch == 0 and batch_idx == self.at:
            raise StopIteration  # e.g. `next()` on an exhausted iterator of the user's own
        return super().training_step(batch, batch_idx)


class StopIterationAfterBatch(pl.Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == self.at:
            raise StopIteration


@pytest.mark.parametrize(
    "how,at",
    [
        ("return -1", 7),  # the last micro-batch of the second window of 4: its first half is set aside
        ("StopIteration in training_step", 7),
        ("StopIteration in a callback", 6),  # after the backward of the second half's first micro-batch
    ],
)
def test_a_window_abandoned_at_the_epochs_end_is_dropped_as_lightning_drops_it(how, at):
    def run(simigrad: bool):
        pl.seed_everything(0)
        dataset = RandomDataset(32, 128)
        model = AbandonsTheEpoch(how, at)
        audit = GradientAudit(boring_loss(dataset))  # forgets a window abandoned at an epoch's end, as Lightning
        callbacks = [audit] + ([StopIterationAfterBatch(at)] if how == "StopIteration in a callback" else [])
        if simigrad:
            cb = SimiGrad(target_similarity=0.95, initial_batch_size=32, adjust=False, lr_scaling="none")
            t = trainer(callbacks=[cb, *callbacks], max_epochs=2)
        else:
            t = trainer(callbacks=callbacks, max_epochs=2, accumulate_grad_batches=4)
        t.fit(model, DataLoader(dataset, batch_size=8, shuffle=True))
        return t, audit

    plain, plain_audit = run(simigrad=False)
    t, audit = run(simigrad=True)
    assert t.global_step == plain.global_step == 1 + 4  # the abandoned window never stepped
    assert [len(s) for s in audit.samples] == [len(s) for s in plain_audit.samples] == [32] * 5
    assert max(plain_audit.errors) < 1e-5
    # the next epoch's first step is the mean over its own samples: nothing of the abandoned window leaks in
    assert max(audit.errors) < 1e-5
