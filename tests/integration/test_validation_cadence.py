"""When Lightning validates, with SimiGrad added: after the samples of its interval (in batches, a fraction of the
epoch, a time), every n-th epoch, after a sanity check; never inside a window; at the cadence of plain Lightning
while ``min_epochs`` or ``min_steps`` hold back an early stop.
"""

from __future__ import annotations

from datetime import timedelta

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import EarlyStopping

from lightning_simigrad import SimiGrad
from tests.support.helpers import trainer
from tests.support.lightning_features import StepsPerEpoch, ValidationsPerEpoch
from tests.support.user_modules import ImagesDataModule, LitClassifier


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(val_check_interval=3), 4),  # every 3 batches of 16 = 48 samples of 224: 4 times per epoch
        (dict(val_check_interval=0.25), 4),
        (dict(val_check_interval=1.0), 1),
        (dict(val_check_interval=5, check_val_every_n_epoch=None), 2),  # 80 samples over the fit of 224
    ],
)
def test_validation_runs_after_the_samples_of_its_interval(kwargs, expected):
    pl.seed_everything(0)
    datamodule = ImagesDataModule(n=256, batch_size=16)
    model = LitClassifier()
    cb = SimiGrad(target_similarity=0.9)
    t = trainer(callbacks=[cb], max_epochs=1, **kwargs)
    t.fit(model, datamodule=datamodule)
    assert len(model.validated) == expected * len(datamodule.val_set)


def test_a_validation_interval_longer_than_the_epoch_is_refused_before_training():
    datamodule = ImagesDataModule(n=256, batch_size=16)
    model = LitClassifier()
    t = trainer(callbacks=[SimiGrad(target_similarity=0.9)], max_epochs=1, val_check_interval=20)
    with pytest.raises(ValueError, match="`val_check_interval` \\(20\\).*14"):
        t.fit(model, datamodule=datamodule)
    assert model.micro_batches == []


def test_sanity_validation_and_every_other_epoch_validation():
    pl.seed_everything(0)
    datamodule = ImagesDataModule(n=256, batch_size=16)
    model = LitClassifier()
    cb = SimiGrad(target_similarity=0.9)
    t = trainer(callbacks=[cb], max_epochs=4, num_sanity_val_steps=2, check_val_every_n_epoch=2)
    t.fit(model, datamodule=datamodule)
    # two sanity batches of 16, then the whole validation set after epochs 2 and 4
    assert len(model.validated) == 2 * 16 + 2 * len(datamodule.val_set)
    assert cb.samples_seen == 4 * len(datamodule.train_set)


@pytest.mark.parametrize("interval", [0.5, 4])
@pytest.mark.parametrize("hold", [dict(min_epochs=3), dict(min_steps=10**6)])
def test_validation_keeps_its_cadence_while_min_epochs_or_min_steps_hold_an_early_stop(interval, hold):
    def run(simigrad: bool):
        pl.seed_everything(0)
        datamodule = ImagesDataModule(n=256, batch_size=16)  # 224 training samples: 14 batches
        stop = EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)  # asks to stop at the second check
        validations = ValidationsPerEpoch()
        callbacks = [SimiGrad(target_similarity=0.9), stop, validations] if simigrad else [stop, validations]
        t = trainer(callbacks=callbacks, max_epochs=3, val_check_interval=interval, **hold)
        t.fit(LitClassifier(), datamodule=datamodule)
        assert t.should_stop
        return validations

    plain = run(simigrad=False)
    assert plain.per_epoch == ({0: 2, 1: 2, 2: 2} if interval == 0.5 else {0: 3, 1: 3, 2: 3})
    validations = run(simigrad=True)
    assert validations.per_epoch == plain.per_epoch
    assert validations.inside_a_window == 0


def test_a_time_based_validation_interval_validates_between_steps():
    def run(simigrad: bool):
        pl.seed_everything(0)
        validations, steps = ValidationsPerEpoch(), StepsPerEpoch()
        callbacks = [SimiGrad(target_similarity=0.9), validations, steps] if simigrad else [validations, steps]
        # an interval that has always elapsed: Lightning validates at every check
        t = trainer(callbacks=callbacks, max_epochs=2, val_check_interval=timedelta(microseconds=1))
        t.fit(LitClassifier(), datamodule=ImagesDataModule(n=256, batch_size=16))
        return validations, steps.steps

    plain, plain_steps = run(simigrad=False)
    assert plain.per_epoch == plain_steps == {0: 14, 1: 14}  # after every step (each batch steps)
    validations, steps = run(simigrad=True)
    assert validations.inside_a_window == 0
    assert validations.per_epoch == steps  # after every step, never inside a window
