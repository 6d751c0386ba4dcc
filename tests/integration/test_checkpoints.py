"""Lightning's checkpoints with SimiGrad added: a fit resumed from ``last.ckpt`` continues the same run, its
step schedule too, also from a checkpoint plain Lightning wrote.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad
from tests.support.helpers import trainer
from tests.support.lightning_features import AppliedLRs, FrequencyTwo, ScheduledBoring
from tests.support.user_modules import RandomDataset


def test_resume_with_a_datamodule_and_a_step_schedule_continues_the_same_run(tmp_path):
    class StopAfter(pl.Callback):
        def __init__(self, epochs):
            self.epochs = epochs

        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch + 1 == self.epochs:
                trainer.should_stop = True

    def run(ckpt_path=None, folder="part", stop_after=None):
        pl.seed_everything(0)
        model = ScheduledBoring("cosine")
        cb = SimiGrad(target_similarity=0.95)
        checkpoint = ModelCheckpoint(dirpath=tmp_path / folder, save_last=True)
        callbacks = [cb, checkpoint] + ([StopAfter(stop_after)] if stop_after else [])
        t = trainer(callbacks=callbacks, max_epochs=4, enable_checkpointing=True)
        t.fit(model, DataLoader(RandomDataset(32, 100), batch_size=8, shuffle=True), ckpt_path=ckpt_path)
        return t, cb

    _, whole = run(folder="whole")
    _, part = run(stop_after=2)  # interrupted after two epochs of the same four-epoch fit
    resumed_trainer, resumed = run(ckpt_path=tmp_path / "part" / "last.ckpt")
    assert len(resumed.history) > 0
    assert [h["lr"] for h in part.history + resumed.history] == pytest.approx([h["lr"] for h in whole.history])
    assert resumed_trainer.lr_scheduler_configs[0].scheduler.last_epoch == 4 * 13


def test_a_frequency_scheduler_resumed_from_a_plain_lightning_checkpoint_keeps_counting_per_epoch(tmp_path):
    data = DataLoader(RandomDataset(32, 100), batch_size=8, shuffle=True)  # 13 batches an epoch
    pl.seed_everything(0)
    whole_lrs = AppliedLRs()
    trainer(callbacks=[whole_lrs], max_epochs=3).fit(FrequencyTwo(), data)
    pl.seed_everything(0)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    part = trainer(callbacks=[checkpoint], max_epochs=2, enable_checkpointing=True)
    part.fit(FrequencyTwo(), data)  # written without SimiGrad: 12 scheduler steps in two epochs
    cb, lrs = SimiGrad(target_similarity=0.95, lr_scaling="none"), AppliedLRs()
    resumed = trainer(callbacks=[cb, lrs], max_epochs=3)
    resumed.fit(FrequencyTwo(), data, ckpt_path=tmp_path / "last.ckpt")
    assert resumed.lr_scheduler_configs[0].scheduler.last_epoch == 3 * (13 // 2)
    assert lrs.at_epoch_end == pytest.approx(whole_lrs.at_epoch_end[-1:], rel=1e-12)
