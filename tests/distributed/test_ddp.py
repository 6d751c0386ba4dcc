"""SimiGrad under DDP: real gloo process groups (Lightning's ``ddp_spawn`` on CPU).

Every rank checks each step against references it computes itself from the explicitly gathered samples
of all ranks, and writes what it saw to a JSON file that the test reads back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad, equilibrium_batch_size
from lightning_simigrad.testing import StepAudit
from tests.support.helpers import (
    NOISE_SCALE,
    IndexedRegression,
    LinearLoss,
    RegressionLoss,
    Regressor,
    batch_indices,
    known_noise_dataset,
    trainer,
)


class DistributedStepChecker(StepAudit):
    """The reference harness on every rank; each rank's audit and SimiGrad's history are written out at the end."""

    def __init__(self, out: Path, dataset: IndexedRegression) -> None:
        super().__init__(indices=batch_indices, mean_loss=RegressionLoss(dataset))
        self.out = out

    def on_train_end(self, trainer, pl_module):
        simigrad = next(c for c in trainer.callbacks if isinstance(c, SimiGrad))
        steps = [dataclasses.asdict(step) for step in self.steps]
        payload = dict(steps=steps, history=simigrad.history, batch_size=simigrad.batch_size)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(payload))


def read_ranks(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ddp_steps_are_exact_identical_and_measure_the_rank_groups(tmp_path, world):
    dataset = IndexedRegression(203)
    cb = SimiGrad(target_similarity=0.9, max_micro_batch_size=6)
    t = trainer(
        devices=world, strategy="ddp_spawn", max_epochs=2, callbacks=[cb, DistributedStepChecker(tmp_path, dataset)]
    )
    t.fit(Regressor(), DataLoader(dataset, batch_size=6, shuffle=True))
    ranks = read_ranks(tmp_path, world)
    history = ranks[0]["history"]
    assert all(r["history"] == history for r in ranks)  # every rank took the same decisions
    steps = ranks[0]["steps"]
    assert len({h["batch_size"] for h in history}) > 2  # the batch moved
    for step, row in zip(steps, history):
        # the step averages exactly simigrad/batch_size samples across all ranks, no duplicates
        every = [i for r in step["per_rank"] for i in r]
        assert len(every) == len(set(every)) == row["batch_size"]
        assert step["ranks_identical"]
        assert step["grad_rel_error"] < 1e-6
        if math.isfinite(row["similarity"]):
            assert row["similarity"] == pytest.approx(step["similarity"], abs=1e-6)
    assert sum(math.isfinite(h["similarity"]) for h in history) >= len(history) - 2  # only tiny tails unmeasured
    # each sample once per epoch across all ranks, short tails included
    seen = [i for s in steps for r in s["per_rank"] for i in r]
    assert sorted(seen) == sorted(list(range(203)) * 2)
    epoch_end = next(k for k in range(len(steps)) if history[k]["samples_seen"] == 203)
    assert sorted(i for s in steps[: epoch_end + 1] for r in s["per_rank"] for i in r) == list(range(203))


class EquilibriumDump(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        cb = next(c for c in trainer.callbacks if isinstance(c, SimiGrad))
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(dict(history=cb.history)))


@pytest.mark.timeout(180)
def test_ddp_batch_size_settles_at_the_equilibrium(tmp_path):
    expected = equilibrium_batch_size(NOISE_SCALE, 0.8)
    # max_steps counts optimizer steps here (not steps of B0 samples): 150 steps, whatever their size
    cb = SimiGrad(target_similarity=0.8, max_micro_batch_size=256, schedule_by_samples=False)
    t = trainer(
        devices=2, strategy="ddp_spawn", max_steps=150, max_epochs=-1, callbacks=[cb, EquilibriumDump(tmp_path)]
    )
    t.fit(LinearLoss(), DataLoader(known_noise_dataset(), batch_size=16, shuffle=True))
    history = read_ranks(tmp_path, 2)[0]["history"]
    assert history[0]["batch_size"] == 32
    settled = statistics.median(h["batch_size"] for h in history[-60:])
    assert 0.8 * expected <= settled <= 1.25 * expected, (settled, expected)
    assert history[-1]["noise_scale"] == pytest.approx(NOISE_SCALE, rel=0.2)


def ddp_run(root: Path, max_epochs: int, ckpt_path=None) -> list[dict]:
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.9, smoothing=0.5, max_batch_size=150)
    checkpoint = ModelCheckpoint(dirpath=root, save_last=True)
    t = trainer(
        devices=2,
        strategy="ddp_spawn",
        max_epochs=max_epochs,
        enable_checkpointing=True,
        callbacks=[cb, checkpoint, EquilibriumDump(root)],
    )
    t.fit(Regressor(), DataLoader(IndexedRegression(200), batch_size=8, shuffle=True), ckpt_path=ckpt_path)
    return read_ranks(root, 2)[0]["history"]


@pytest.mark.timeout(180)
def test_ddp_resume_continues_the_same_run(tmp_path):
    whole = ddp_run(tmp_path / "whole", max_epochs=3)
    part = ddp_run(tmp_path / "part", max_epochs=2)
    resumed = ddp_run(tmp_path / "part", max_epochs=3, ckpt_path=tmp_path / "part" / "last.ckpt")
    combined = part + resumed
    assert [h["batch_size"] for h in combined] == [h["batch_size"] for h in whole]
    assert [h["similarity"] for h in combined] == pytest.approx([h["similarity"] for h in whole], abs=1e-9)


class UserCommHook(pl.Callback):
    def on_fit_start(self, trainer, pl_module):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        trainer.strategy.model.register_comm_hook(None, default_hooks.allreduce_hook)


@pytest.mark.timeout(180)
def test_a_users_comm_hook_is_refused_not_replaced(tmp_path):
    t = trainer(devices=2, strategy="ddp_spawn", callbacks=[UserCommHook(), SimiGrad(target_similarity=0.8)])
    with pytest.raises(Exception, match="comm(unication)? hook"):
        t.fit(Regressor(), DataLoader(IndexedRegression(64), batch_size=8))


class AbandonsTheFirstEpoch(Regressor):
    """Ends epoch 0 on every rank at micro-batch ``at`` (Lightning's documented -1 from `on_train_batch_start`)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if self.current_epoch == 0 and batch_idx == self.at else None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("at", [7, 5])  # the last micro-batch of the second window (armed, then dropped); its third
def test_a_ddp_window_abandoned_at_the_epochs_end_is_dropped_on_every_rank(tmp_path, at):
    dataset = IndexedRegression(128)
    # windows of 32 samples: 4 micro-batches of 4 per rank on 2 ranks
    cb = SimiGrad(target_similarity=0.9, initial_batch_size=32, adjust=False, lr_scaling="none")
    t = trainer(
        devices=2, strategy="ddp_spawn", max_epochs=2, callbacks=[cb, DistributedStepChecker(tmp_path, dataset)]
    )
    t.fit(AbandonsTheFirstEpoch(at), DataLoader(dataset, batch_size=4, shuffle=True))
    ranks = read_ranks(tmp_path, 2)
    history, steps = ranks[0]["history"], ranks[0]["steps"]
    assert all(r["history"] == history for r in ranks)
    # epoch 0 stepped once (its second window was abandoned), epoch 1 four times: as plain Lightning
    assert len(steps) == len(history) == 5
    for step in steps:  # every step, the first of epoch 1 too, is the mean over exactly its own 32 samples
        assert len(step["samples"]) == len(set(step["samples"])) == 32
        assert step["ranks_identical"] and step["grad_rel_error"] < 1e-6
    assert sorted(i for s in steps[1:] for i in s["samples"]) == list(range(128))  # epoch 1: every sample once
    assert all(math.isfinite(h["similarity"]) for h in history)  # the aborted measurement left nothing behind
    assert history[1]["similarity"] == pytest.approx(steps[1]["similarity"], abs=1e-6)
