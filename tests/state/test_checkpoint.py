"""SimiGrad's checkpointed state, spelled out: the format a resumed fit reads, and who hands each piece of it."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad
from lightning_simigrad.state.checkpoint import FORMAT_VERSION, validate_state
from tests.support.helpers import IndexedRegression, Regressor, trainer


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

    assert list(state) == ["format_version", "run", "counts", "schedule", "controller", "progress", "rng"]
    assert state["format_version"] == FORMAT_VERSION == 2
    assert state["run"] == {"initial_batch_size": 8, "world_size": 1, "epoch_length": 100}
    counts = state["counts"]
    assert list(counts) == ["steps", "samples_seen", "weight_seen", "epoch_samples_done"]
    assert all(type(v) is int for v in counts.values())
    assert 0 < counts["epoch_samples_done"] < 100 and counts["samples_seen"] == 100 + counts["epoch_samples_done"]
    assert counts["weight_seen"] == counts["samples_seen"]  # batches counted in samples: every sample weighs 1
    schedule = state["schedule"]
    assert list(schedule) == ["batch_size", "seed", "epoch", "planned", "epoch_offset", "planned_tails"]
    assert schedule["epoch"] == 1
    assert all(type(schedule[k]) is int for k in ("batch_size", "seed")) and schedule["epoch_offset"] == 0
    assert isinstance(schedule["planned"], list) and all(type(size) is int for size in schedule["planned"])
    assert [type(tail) for tail in schedule["planned_tails"]] == [bool] * len(schedule["planned"])
    assert list(state["controller"]) == [
        "size",
        "measured_steps",
        "similarity_ema",
        "referenced_grad_sq_ema",
        "referenced_trace_sigma_ema",
        "reference",
        "referenced_grad_sq_square_ema",
    ]
    emas = ("similarity_ema", "referenced_grad_sq_ema", "referenced_trace_sigma_ema", "referenced_grad_sq_square_ema")
    assert all(len(state["controller"][k]) == 2 for k in emas)  # an EMA: [biased, weight]
    assert state["controller"]["reference"] > 0  # the last step's mean |g_half|^2
    # the one step-interval scheduler's steps: at least the first epoch's 13 B0-steps
    assert list(state["progress"]) == ["scheduler_steps"] and len(state["progress"]["scheduler_steps"]) == 1
    assert state["progress"]["scheduler_steps"][0] >= 13
    assert len(state["rng"]) == 1 and set(state["rng"][0]) == {"torch", "python", "numpy"}
    assert validate_state(state, "mid.ckpt") == state


def test_each_part_of_the_state_is_handed_by_the_component_that_owns_it():
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.9, max_batch_size=64)
    t = trainer(callbacks=[cb], max_epochs=1)
    t.fit(Regressor(scheduler=True), DataLoader(IndexedRegression(60), batch_size=8, shuffle=True))
    run = cb.run
    state = cb.state_dict()
    assert state["controller"] == run.controller.state_dict()
    assert state["schedule"] == run.schedule.state_dict()
    assert state["counts"] == run.counts.state_dict()
    assert state["run"] == run.facts.state_dict()
    counts = state["counts"]
    assert (counts["samples_seen"], counts["steps"], counts["epoch_samples_done"]) == (60, cb.steps, 60)
    assert state["progress"] == {"scheduler_steps": [8]}  # ceil(60 / 8) B0-steps of the step-interval schedule


def test_a_format_1_checkpoint_resumes_where_it_left_off(tmp_path):
    """A checkpoint written by the previous release (one flat dict) still resumes: every value reaches its owner."""
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.9, max_batch_size=64)
    t = trainer(callbacks=[cb, SaveInsideTheSecondEpoch(tmp_path / "mid.ckpt")], max_epochs=2)
    t.fit(Regressor(scheduler=True), DataLoader(IndexedRegression(100), batch_size=8, shuffle=True))
    checkpoint = torch.load(tmp_path / "mid.ckpt", weights_only=False)
    new = checkpoint["callbacks"]["SimiGrad"]
    # the same state as format 1 wrote it, flat, in format 1's order
    old = {
        "format_version": 1,
        **new["run"],
        **{k: v for k, v in new["counts"].items() if k != "weight_seen"},
        **new["schedule"],
        "controller": new["controller"],
        "progress": new["progress"],
        "rng": new["rng"],
    }
    checkpoint["callbacks"]["SimiGrad"] = old
    torch.save(checkpoint, tmp_path / "format1.ckpt")

    histories = []
    for path in ("mid.ckpt", "format1.ckpt"):
        pl.seed_everything(0)
        resumed = SimiGrad(target_similarity=0.9, max_batch_size=64)
        t = trainer(callbacks=[resumed], max_epochs=2)
        t.fit(Regressor(scheduler=True), DataLoader(IndexedRegression(100), batch_size=8, shuffle=True),
              ckpt_path=tmp_path / path)  # fmt: skip
        histories.append([(h["step"], h["batch_size"], h["samples_seen"]) for h in resumed.history])
        assert resumed.run.counts.samples_seen == 200
    assert histories[0] and histories[0] == histories[1]
