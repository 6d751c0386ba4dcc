"""Lightning's tuners with SimiGrad added: the batch-size finder tunes the micro-batch, the learning-rate finder runs
at the user's batch, and a batch-size finder that a fixed micro-batch would contradict is refused.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.tuner import Tuner

from lightning_simigrad import SimiGrad
from tests.support.helpers import trainer
from tests.support.user_modules import ImagesDataModule, LitClassifier


class TunableClassifier(LitClassifier):
    """Runs out of memory above 24 samples per micro-batch, as a GPU would."""

    def training_step(self, batch, batch_idx):
        if len(batch[0]) > 24:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().training_step(batch, batch_idx)


def test_batch_size_finder_tunes_the_micro_batch_simigrad_then_uses(tmp_path):
    pl.seed_everything(0)
    datamodule = ImagesDataModule(n=256, batch_size=4)
    model = TunableClassifier()
    cb = SimiGrad(target_similarity=0.99, max_batch_size=128)  # grows fast: windows soon need accumulation
    t = trainer(callbacks=[cb], max_epochs=2, default_root_dir=tmp_path)
    found = Tuner(t).scale_batch_size(model, datamodule=datamodule, mode="power", steps_per_trial=2)
    trials = sorted({len(m) for m in model.micro_batches})
    assert trials == [4, 8, 16] and found == 16  # plain batches of the trial sizes; 32 ran out of memory
    model.micro_batches = []
    t.fit(model, datamodule=datamodule)
    sizes = [len(m) for m in model.micro_batches]
    assert 8 < max(sizes) <= 16  # the tuned size is the micro-batch cap ...
    assert cb.history[0]["batch_size"] == 4  # ... while B0 stays the batch the learning rate was set for
    assert max(h["batch_size"] for h in cb.history) > 16


def test_learning_rate_finder_runs_at_the_users_batch(tmp_path):
    pl.seed_everything(0)
    datamodule = ImagesDataModule(n=256, batch_size=16)
    model = LitClassifier()
    cb = SimiGrad(target_similarity=0.9)
    t = trainer(callbacks=[cb], max_epochs=1, default_root_dir=tmp_path)
    finder = Tuner(t).lr_find(model, datamodule=datamodule, num_training=12, early_stop_threshold=None)
    assert {len(m) for m in model.micro_batches} == {16}  # the user's batch, not SimiGrad's halves of it
    assert len(finder.results["lr"]) == 12
    model.micro_batches = []
    t.fit(model, datamodule=datamodule)
    assert cb.samples_seen == len(datamodule.train_set)


def test_a_batch_size_finder_with_a_fixed_micro_batch_is_refused(tmp_path):
    from lightning.pytorch.callbacks import BatchSizeFinder

    datamodule = ImagesDataModule(n=256, batch_size=4)
    model = LitClassifier()
    t = trainer(callbacks=[SimiGrad(0.9, max_micro_batch_size=8), BatchSizeFinder()], default_root_dir=tmp_path)
    with pytest.raises(RuntimeError, match="`max_micro_batch_size=8`"):
        t.fit(model, datamodule=datamodule)
    assert model.micro_batches == []
