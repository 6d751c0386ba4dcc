"""The data Lightning feeds, with SimiGrad added: a DataModule, evaluation after the fit, and the limits on an
epoch's batches (``limit_train_batches``, ``fast_dev_run``): exactly the samples plain Lightning would feed, and
every step's gradient the mean over exactly its samples.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from lightning_simigrad import SimiGrad
from tests.support.helpers import trainer
from tests.support.lightning_features import fit_boring
from tests.support.user_modules import ImagesDataModule, LitClassifier


def test_a_datamodule_feeds_every_sample_once_per_epoch():
    pl.seed_everything(0)
    datamodule = ImagesDataModule(n=256, batch_size=16)
    model = LitClassifier()
    cb = SimiGrad(target_similarity=0.9, max_batch_size=96)
    t = trainer(callbacks=[cb], max_epochs=3)
    t.fit(model, datamodule=datamodule)
    seen = [i for m in model.micro_batches for i in m]
    train_indices = sorted(datamodule.train_set.indices)
    assert len(seen) == 3 * len(train_indices) == cb.samples_seen
    for epoch in range(3):
        part = seen[epoch * len(train_indices) : (epoch + 1) * len(train_indices)]
        assert sorted(part) == train_indices
    assert len({h["batch_size"] for h in cb.history}) > 2  # the batch moved
    assert sorted(model.validated) == sorted(list(datamodule.val_set.indices) * 3)  # validated once per epoch


def test_validate_test_and_predict_after_fit_see_their_whole_data():
    pl.seed_everything(0)
    datamodule = ImagesDataModule(n=128, batch_size=16)
    model = LitClassifier()
    cb = SimiGrad(target_similarity=0.9)
    t = trainer(callbacks=[cb], max_epochs=1)
    t.fit(model, datamodule=datamodule)
    model.validated = []
    t.validate(model, datamodule=datamodule, verbose=False)
    assert sorted(model.validated) == sorted(datamodule.val_set.indices)
    assert "test_acc" in t.test(model, datamodule=datamodule, verbose=False)[0]
    predicted = [i for idx, _ in t.predict(model, datamodule=datamodule) for i in idx.tolist()]
    assert sorted(predicted) == sorted(datamodule.val_set.indices)


@pytest.mark.parametrize("limit", [1, 2, 3, 4, 5, 6, 7, 8, 9])
def test_limit_train_batches_feeds_the_samples_of_its_batches_for_every_residue(limit):
    # windows of 32 samples (4 micro-batches of 8); limit k feeds the samples of k batches of 8 per epoch
    cb = SimiGrad(target_similarity=0.5, initial_batch_size=32, adjust=False)
    t, model, audit = fit_boring(cb, max_epochs=2, limit_train_batches=limit)
    per_epoch = 8 * limit
    seen = [i for s in audit.samples for i in s]
    assert len(seen) == 2 * per_epoch == cb.samples_seen
    assert len(set(seen[:per_epoch])) == per_epoch and len(set(seen[per_epoch:])) == per_epoch
    assert max(audit.errors) < 1e-5  # every step's gradient is the mean over exactly its samples
    assert all(len(m) >= 2 for m in model.micro_batches)  # no one-sample micro-batch at the cut


def test_fractional_limit_train_batches_feeds_that_fraction_of_the_samples():
    cb = SimiGrad(target_similarity=0.9)
    t, model, audit = fit_boring(cb, max_epochs=2, limit_train_batches=0.3)
    assert cb.samples_seen == 2 * int(128 * 0.3)
    assert max(audit.errors) < 1e-5


@pytest.mark.parametrize("fast_dev_run", [True, 5])
def test_fast_dev_run_trains_its_batches_exactly(fast_dev_run):
    cb = SimiGrad(target_similarity=0.9)
    t, model, audit = fit_boring(cb, fast_dev_run=fast_dev_run)
    batches = 1 if fast_dev_run is True else fast_dev_run
    assert cb.samples_seen == 8 * batches == len({i for s in audit.samples for i in s})
    assert max(audit.errors) < 1e-5
    assert all(p.grad is not None for p in model.parameters())  # no half of a window left aside
