"""The SimiGrad callback on one process, in real Trainer fits on CPU."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad
from tests.support.helpers import IndexedRegression, Regressor, step_audit, trainer


def fit(simigrad, n=300, batch_size=16, num_workers=0, drop_last=False, shuffle=True, model=None, **trainer_kwargs):
    pl.seed_everything(0)  # the model's initialisation steers the decisions, hence the epoch tails
    dataset = IndexedRegression(n)
    recorder, decisions = step_audit(dataset), Decisions()
    model = model or Regressor()
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers, drop_last=drop_last)
    t = trainer(callbacks=[simigrad, recorder, decisions], **trainer_kwargs)
    t.fit(model, loader)
    return t, model, recorder


class Decisions(pl.Callback):
    """The batch size SimiGrad asks for after each step."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        simigrad = next(c for c in trainer.callbacks if isinstance(c, SimiGrad))
        if len(self.sizes) < len(simigrad.history):
            self.sizes.append(simigrad.batch_size)


@pytest.mark.parametrize(
    "num_workers,drop_last,max_micro",
    [(0, False, None), (2, False, 8), (0, True, 5), (2, True, None)],
)
def test_every_step_averages_exactly_its_samples(num_workers, drop_last, max_micro):
    cb = SimiGrad(target_similarity=0.9, max_micro_batch_size=max_micro, max_batch_size=120)
    t, model, rec = fit(cb, num_workers=num_workers, drop_last=drop_last, max_epochs=2)
    assert len(rec.steps) == len(cb.history) == t.global_step
    sizes = [len(s.samples) for s in rec.steps]
    assert [int(h["batch_size"]) for h in cb.history] == sizes
    assert len(set(sizes)) > 2  # the batch did move
    cap = max_micro or 16
    for step, row in zip(rec.steps, cb.history):
        assert max(step.micro_batches) <= cap
        assert row["accumulation"] == len(step.micro_batches)
        assert len(step.micro_batches) >= 2 or len(step.samples) == 1  # only a 1-sample tail cannot be halved
        # the gradient the optimizer steps with is the mean-loss gradient over exactly these samples
        assert step.grad_rel_error < 1e-12
    # every epoch feeds each sample once; with drop_last only a tail smaller than its window is left out
    seen = [i for s in rec.steps for i in s.samples]
    counts = torch.bincount(torch.tensor(seen), minlength=300)
    if not drop_last:
        assert counts.tolist() == [2] * 300
    else:
        assert counts.max() <= 2
        assert 0 < 600 - len(seen) < 2 * 120  # at most one window's worth dropped per epoch
    assert cb.history[-1]["samples_seen"] == len(seen)
    # fine-grained: every full window is exactly a size the controller chose (no rounding to micro x steps)
    # (an epoch's last step, ending on a multiple of 300 samples, averages what is left, or shares it with the step
    # before)
    chosen = {16, *next(c for c in t.callbacks if isinstance(c, Decisions)).sizes}
    ends = [i for i, h in enumerate(cb.history) if h["samples_seen"] % 300 == 0]
    tails = {*ends, *(i - 1 for i in ends)}
    full = [h for i, h in enumerate(cb.history) if drop_last or i not in tails]
    assert all(int(h["batch_size"]) in chosen for h in full)


def test_epoch_coverage_with_shuffle_and_workers():
    cb = SimiGrad(target_similarity=0.5)
    t, model, rec = fit(cb, n=257, batch_size=10, num_workers=2, max_epochs=3)
    seen = [i for s in rec.steps for i in s.samples]
    assert len(seen) == 3 * 257
    epochs, start = [], 0
    for _ in range(3):
        epochs.append(seen[start : start + 257])
        start += 257
    for e in epochs:
        assert sorted(e) == list(range(257))  # exactly once per epoch, epoch tail included
    assert epochs[0] != epochs[1]  # shuffled anew each epoch


def test_similarity_is_the_cosine_of_the_window_halves():
    cb = SimiGrad(target_similarity=0.8, max_micro_batch_size=6)
    t, model, rec = fit(cb, max_epochs=1)
    for step, row in zip(rec.steps, cb.history):
        if not step.halves[0]:  # a one-sample epoch tail has no halves
            assert len(step.samples) == 1 and math.isnan(row["similarity"]) and math.isnan(step.similarity)
            continue
        assert row["similarity"] == pytest.approx(step.similarity, abs=1e-9)  # the cosine of the halves' gradients


def test_adjust_false_measures_and_never_changes_the_batch():
    cb = SimiGrad(target_similarity=0.99, adjust=False)
    t, model, rec = fit(cb, n=320, batch_size=16)
    assert {h["batch_size"] for h in cb.history} == {16.0}
    assert all(math.isfinite(h["similarity"]) for h in cb.history)
    assert cb.controller.measured_steps == t.global_step


def test_learning_rate_is_scaled_only_inside_the_step():
    seen = []

    class LrProbe(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            optimizer = trainer.optimizers[0]
            optimizer.register_step_pre_hook(lambda opt, a, k: seen.append(opt.param_groups[0]["lr"]))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            scheduler = trainer.lr_scheduler_configs[0].scheduler
            assert trainer.optimizers[0].param_groups[0]["lr"] == scheduler.get_last_lr()[0]

    cb = SimiGrad(target_similarity=0.95, lr_scaling="sqrt")
    dataset = IndexedRegression(300)
    model = Regressor(scheduler=True)
    t = trainer(callbacks=[cb, LrProbe()], gradient_clip_val=0.5)
    t.fit(model, DataLoader(dataset, batch_size=16, shuffle=True))
    # StepLR(step_size=3, gamma=0.5) per step of B0 = 16 samples: a step applies the schedule at the middle
    # of the B0-steps its samples span
    before = [0] + [int(h["samples_seen"]) for h in cb.history[:-1]]
    middle = [(2 * done + int(h["batch_size"]) - 16) // 32 for done, h in zip(before, cb.history)]
    scheduled = [0.05 * 0.5 ** (step // 3) for step in middle]
    assert len({h["batch_size"] for h in cb.history}) > 2
    for lr, sched, row in zip(seen, scheduled, cb.history):
        assert row["lr_scale"] == pytest.approx(math.sqrt(row["batch_size"] / 16))
        assert lr == pytest.approx(sched * row["lr_scale"])
        assert row["lr"] == pytest.approx(lr)  # `simigrad/lr` is the learning rate the step applied
    assert len(seen) == t.global_step


def test_logged_metrics_reach_the_loggers(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    cb = SimiGrad(target_similarity=0.8)
    dataset = IndexedRegression(200)
    t = trainer(callbacks=[cb], logger=CSVLogger(tmp_path), log_every_n_steps=50)
    t.fit(Regressor(), DataLoader(dataset, batch_size=16))
    import csv

    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    logged = [r for r in rows if r.get("simigrad/batch_size")]
    assert len(logged) == t.global_step  # every optimizer step, not every 50
    for name in (
        "batch_size",
        "similarity",
        "lr_scale",
        "micro_batch_size",
        "accumulation",
        "samples_seen",
        "noise_scale",
    ):
        assert f"simigrad/{name}" in rows[0]
    assert [float(r["simigrad/batch_size"]) for r in logged] == [h["batch_size"] for h in cb.history]


def test_a_limited_epoch_feeds_the_samples_of_its_batches_in_whole_windows():
    cb = SimiGrad(target_similarity=0.8, initial_batch_size=64, max_micro_batch_size=8)
    t, model, rec = fit(cb, limit_train_batches=11)
    # 11 batches of 16 samples: 176 samples, as windows of 64, 64 and the last 48
    assert [len(s.samples) for s in rec.steps] == [64, 64, 48]
    assert [len(s.micro_batches) for s in rec.steps] == [8, 8, 6]
    assert len(set(i for s in rec.steps for i in s.samples)) == 176
    assert all(step.grad_rel_error < 1e-12 for step in rec.steps)


class EpochOrders(pl.Callback):
    """The samples each training epoch fed, in order."""

    def __init__(self) -> None:
        self.epochs: list[list[int]] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.epochs.append([])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.epochs[-1] += batch[0].tolist()


def test_a_callback_reused_on_another_trainer_counts_that_trainers_epochs():
    pl.seed_everything(0)
    dataset, simigrad = IndexedRegression(64), SimiGrad(target_similarity=0.5, max_micro_batch_size=8)
    model = Regressor()
    trainer(callbacks=[simigrad], max_epochs=1).fit(model, DataLoader(dataset, batch_size=8, shuffle=True))
    orders = EpochOrders()
    second = trainer(callbacks=[simigrad, orders], max_epochs=3)
    second.fit(model, DataLoader(dataset, batch_size=8, shuffle=True))
    assert len(orders.epochs) == 3 and all(sorted(e) == list(range(64)) for e in orders.epochs)  # each sample once
    # the second Trainer's epochs are shuffled as its own epochs 0, 1, 2: three different orders
    assert len({tuple(e) for e in orders.epochs}) == 3
    assert simigrad.run is not None and simigrad.run.epoch() == second.fit_loop.epoch_progress.current.processed
