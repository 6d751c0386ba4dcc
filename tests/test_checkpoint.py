"""SimiGrad's checkpointed state, spelled out: the format a resumed fit reads, and who hands each piece of it."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from helpers import IndexedRegression, Regressor, trainer
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad
from lightning_simigrad.state.checkpoint import FORMAT_VERSION, validate_state


class SaveInsideTheSecondEpoch(pl.Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 1 and batch_idx == 3:
            trainer.save_checkpoint(self.path)


def test_the_state_in_a_checkpoint_is_this_structure(tmp_path):
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.9, max_batch_size=64)
    model = Regressor(scheduler=True)
    t = trainer(callbacks=[cb, SaveInsideTheSecondEpoch(tmp_path / "mid.ckpt")], max_epochs=2)
    t.fit(model, DataLoader(IndexedRegression(100), batch_size=8, shuffle=True))
    state = torch.load(tmp_path / "mid.ckpt", weights_only=False)["callbacks"]["SimiGrad"]

    assert list(state) == [
        "format_version",
        "initial_batch_size",
        "samples_seen",
        "steps",
        "epoch_samples_done",
        "epoch_length",
        "world_size",
        "batch_size",
        "seed",
        "epoch",
        "planned",
        "controller",
        "progress",
        "rng",
    ]
    assert state["format_version"] == FORMAT_VERSION == 1
    assert (state["initial_batch_size"], state["epoch_length"], state["world_size"], state["epoch"]) == (8, 100, 1, 1)
    assert all(type(state[k]) is int for k in ("samples_seen", "steps", "epoch_samples_done", "batch_size", "seed"))
    assert 0 < state["epoch_samples_done"] < 100 and state["samples_seen"] == 100 + state["epoch_samples_done"]
    assert isinstance(state["planned"], list) and all(type(size) is int for size in state["planned"])
    assert list(state["controller"]) == [
        "size",
        "measured_steps",
        "similarity_ema",
        "referenced_grad_sq_ema",
        "referenced_trace_sigma_ema",
        "reference",
    ]
    assert all(len(state["controller"][k]) == 2 for k in list(state["controller"])[2:5])  # an EMA: [biased, weight]
    assert state["controller"]["reference"] > 0  # the last step's mean |g_half|^2
    # the one step-interval scheduler's steps: at least the first epoch's 13 B0-steps
    assert list(state["progress"]) == ["scheduler_steps"] and len(state["progress"]["scheduler_steps"]) == 1
    assert state["progress"]["scheduler_steps"][0] >= 13
    assert len(state["rng"]) == 1 and set(state["rng"][0]) == {"torch", "python", "numpy"}
    assert validate_state(state, "mid.ckpt") is state


def test_each_part_of_the_state_is_handed_by_the_component_that_owns_it():
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.9, max_batch_size=64)
    t = trainer(callbacks=[cb], max_epochs=1)
    t.fit(Regressor(scheduler=True), DataLoader(IndexedRegression(60), batch_size=8, shuffle=True))
    run = cb.run
    state = cb.state_dict()
    assert state["controller"] == run.controller.state_dict()
    assert {k: state[k] for k in ("batch_size", "seed", "epoch", "planned")} == run.schedule.state_dict()
    assert (state["samples_seen"], state["steps"], state["epoch_samples_done"]) == (60, cb.steps, 60)
    assert state["progress"] == {"scheduler_steps": [8]}  # ceil(60 / 8) B0-steps of the step-interval schedule
