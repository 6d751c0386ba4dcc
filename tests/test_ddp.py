"""SimiGrad under DDP: real gloo process groups (Lightning's ``ddp_spawn`` on CPU).

Every rank checks each step against references it computes itself from the explicitly gathered samples
of all ranks, and writes what it saw to a JSON file that the test reads back.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import IndexedRegression, Regressor, trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from test_equilibrium import NOISE_SCALE, LinearLoss, known_noise_dataset
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad, equilibrium_batch_size


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


class DistributedStepChecker(pl.Callback):
    """After SimiGrad: per step, the gradient and similarity against references from gathered samples."""

    def __init__(self, out: Path, dataset: IndexedRegression) -> None:
        self.out, self.dataset = out, dataset

    def on_fit_start(self, trainer, pl_module):
        self.simigrad = next(c for c in trainer.callbacks if isinstance(c, SimiGrad))
        self.pending: list[int] = []
        self.steps: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.simigrad.local_samples:  # a zero-weight padding sample is no sample of the step
            self.pending.extend(batch[0].tolist())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        world = trainer.world_size
        per_rank: list[list[int]] = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(per_rank, self.pending)
        self.pending = []
        grads = flat([p.grad for p in pl_module.parameters()])
        gathered = [torch.empty_like(grads) for _ in range(world)]
        dist.all_gather(gathered, grads)
        half = world // 2  # group A: the first floor(W / 2) ranks
        every = [i for r in per_rank for i in r]
        group_a = [i for r in per_rank[:half] for i in r]
        group_b = [i for r in per_rank[half:] for i in r]
        reference = self._gradient(pl_module, every)
        g_a, g_b = self._gradient(pl_module, group_a), self._gradient(pl_module, group_b)
        self.steps.append(
            dict(
                per_rank=per_rank,
                grad_rel_error=float((grads - reference).norm() / reference.norm()),
                ranks_identical=all(torch.equal(g, gathered[0]) for g in gathered),
                similarity=float(g_a @ g_b / (g_a.norm() * g_b.norm())),
            )
        )

    def _gradient(self, pl_module, indices) -> torch.Tensor:
        model = copy.deepcopy(pl_module.net)
        loss = torch.nn.functional.mse_loss(model(self.dataset.x[indices]), self.dataset.y[indices])
        loss.backward()
        return flat([p.grad for p in model.parameters()])

    def on_train_end(self, trainer, pl_module):
        payload = dict(steps=self.steps, history=self.simigrad.history, batch_size=self.simigrad.batch_size)
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
