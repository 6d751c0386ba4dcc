"""Checkpoints carry SimiGrad's state: a resumed run continues with the same batch size and controller."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers import IndexedRegression, Regressor, trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad


def run(tmp_path, max_epochs, ckpt_path=None, every_n_train_steps=None, max_steps=-1):
    pl.seed_everything(0)
    model = Regressor()
    cb = SimiGrad(target_similarity=0.9, smoothing=0.5, max_batch_size=150)
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, save_last=True, save_top_k=-1, every_n_train_steps=every_n_train_steps
    )
    t = trainer(callbacks=[cb, checkpoint], max_epochs=max_epochs, max_steps=max_steps, enable_checkpointing=True)
    t.fit(model, DataLoader(IndexedRegression(300), batch_size=16, shuffle=True), ckpt_path=ckpt_path)
    return t, cb, model


def test_resume_at_an_epoch_end_continues_the_same_run(tmp_path):
    _, whole, _ = run(tmp_path / "whole", max_epochs=4)
    first, part, _ = run(tmp_path / "part", max_epochs=2)
    state = torch.load(tmp_path / "part" / "last.ckpt", weights_only=False)["callbacks"]["SimiGrad"]
    assert state["batch_size"] == part.batch_size
    assert state["samples_seen"] == 600
    assert state["controller"] == part.controller.state_dict()
    t, resumed, _ = run(tmp_path / "part", max_epochs=4, ckpt_path=tmp_path / "part" / "last.ckpt")
    assert resumed.history[0]["samples_seen"] == 600 + resumed.history[0]["batch_size"]
    # the same batch sizes, similarities and learning-rate factors as the uninterrupted run
    combined = part.history + resumed.history
    assert [h["batch_size"] for h in combined] == [h["batch_size"] for h in whole.history]
    assert [h["similarity"] for h in combined] == pytest.approx([h["similarity"] for h in whole.history])
    a, b = resumed.controller.state_dict(), whole.controller.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key])


def test_resume_mid_epoch_feeds_the_rest_of_the_epoch_exactly(tmp_path):
    _, part, model = run(tmp_path, max_epochs=1, every_n_train_steps=4, max_steps=4)
    before = [i for m in model.micro_batches for i in m]
    assert len(before) < 300
    t, resumed, model = run(tmp_path, max_epochs=1, ckpt_path=tmp_path / "last.ckpt")
    after = [i for m in model.micro_batches for i in m]
    assert sorted(before + after) == list(range(300))  # no sample twice, none lost
    assert resumed.history[0]["samples_seen"] == len(before) + resumed.history[0]["batch_size"]
