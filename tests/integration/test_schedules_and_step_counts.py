"""Learning-rate schedules and Lightning's step counts, with SimiGrad added.

Schedules written for steps of B0 samples (over ``estimated_stepping_batches``, or stepped every few batches) run
once over the fit whatever the batch; ``max_steps`` counts steps of B0 samples and ends the fit whatever
``min_epochs`` or ``min_steps`` say; ``accumulate_grad_batches`` reads the window's length, and what else sets it
is refused.
"""

from __future__ import annotations

import copy
import math

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad
from tests.support.helpers import trainer
from tests.support.lightning_features import AppliedLRs, FrequencyTwo, ScheduledBoring, fit_boring, make_scheduler
from tests.support.user_modules import BoringModel, RandomDataset, TransformerStyle


def reference_scheduler(idiom: str, steps: int):
    """The same schedule, stepped ``steps`` times on its own."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    scheduler = make_scheduler(optimizer, idiom, TOTAL)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return scheduler


TOTAL = 3 * math.ceil(100 / 8)


@pytest.mark.parametrize("idiom", ["onecycle", "cosine", "linear"])
def test_step_schedules_over_estimated_stepping_batches_run_once_over_the_fit(idiom):
    pl.seed_everything(0)
    model = ScheduledBoring(idiom)
    cb = SimiGrad(target_similarity=0.95)
    t = trainer(callbacks=[cb], max_epochs=3)
    t.fit(model, DataLoader(RandomDataset(32, 100), batch_size=8, shuffle=True))
    scheduler = t.lr_scheduler_configs[0].scheduler
    # the schedule, written for steps of B0 = 8 samples, took exactly the steps a fixed batch of 8 takes
    assert scheduler.last_epoch == TOTAL
    assert t.global_step < TOTAL / 2  # in far fewer optimizer steps: the batch grew
    assert scheduler.get_last_lr() == pytest.approx(reference_scheduler(idiom, TOTAL).get_last_lr(), abs=1e-12)
    # each step applied the schedule's value at the middle of the B0-steps it spans, times sqrt(B / B0)
    done = 0
    for row in cb.history:
        epoch, within = divmod(done, 100)
        middle = epoch * 13 + (2 * within + int(row["batch_size"]) - 8) // 16
        expected = reference_scheduler(idiom, middle).get_last_lr()[0] * math.sqrt(row["batch_size"] / 8)
        assert row["lr"] == pytest.approx(expected, rel=1e-9, abs=1e-15)
        done += int(row["batch_size"])
    assert cb.history[-1]["lr"] < 0.2 * max(h["lr"] for h in cb.history)  # it decayed


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_transformer_tutorial_schedule_moves_the_parameters_and_ends_at_zero(drop_last):
    pl.seed_everything(0)
    model = TransformerStyle()
    model.train_dataloader = lambda: DataLoader(RandomDataset(32, 100), batch_size=8, shuffle=True, drop_last=drop_last)
    before = copy.deepcopy(model.layer.weight.detach())
    cb = SimiGrad(target_similarity=0.95)
    t = trainer(callbacks=[cb], max_epochs=4)
    t.fit(model)
    assert not torch.equal(before, model.layer.weight)
    scheduler = t.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 4 * (100 // 8 if drop_last else math.ceil(100 / 8))
    assert scheduler.get_last_lr()[0] == 0.0


def test_schedules_follow_optimizer_steps_when_asked():
    class PerStep(BoringModel):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.95, schedule_by_samples=False)
    t = trainer(callbacks=[cb], max_epochs=2)
    t.fit(PerStep())
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == t.global_step < 2 * 128 / 8


@pytest.mark.parametrize("adjust", [False, True])
def test_a_step_scheduler_with_a_frequency_counts_its_batches_within_each_epoch(adjust):
    def run(cb):
        pl.seed_everything(0)
        lrs = AppliedLRs()
        t = trainer(callbacks=[cb, lrs] if cb else [lrs], max_epochs=3)
        t.fit(FrequencyTwo(), DataLoader(RandomDataset(32, 100), batch_size=8, shuffle=True))  # 13 batches
        return t, lrs

    plain, plain_lrs = run(None)
    assert plain.lr_scheduler_configs[0].scheduler.last_epoch == 3 * (13 // 2)
    cb = SimiGrad(target_similarity=0.95, adjust=adjust, lr_scaling="none")
    t, lrs = run(cb)
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == 3 * (13 // 2)
    assert lrs.at_epoch_end == pytest.approx(plain_lrs.at_epoch_end, rel=1e-12)
    if not adjust:  # every step is a step of B0 = 8 samples: the learning rates step for step
        assert [int(h["batch_size"]) for h in cb.history] == ([8] * 12 + [4]) * 3
        assert [h["lr"] for h in cb.history] == pytest.approx(plain_lrs.lrs, rel=1e-12)


def test_max_steps_counts_steps_of_b0_samples_and_max_samples_bounds_the_fit():
    cb = SimiGrad(target_similarity=0.95)
    t, _, audit = fit_boring(cb, max_steps=7, max_epochs=-1)
    assert cb.samples_seen == 7 * 8  # the samples 7 steps at B0 = 8 would have trained
    assert t.global_step < 7 and max(audit.errors) < 1e-5
    estimates = []

    class Estimating(BoringModel):
        def configure_optimizers(self):
            estimates.append(self.trainer.estimated_stepping_batches)
            return super().configure_optimizers()

    cb = SimiGrad(target_similarity=0.95, max_samples=300)
    t, _, audit = fit_boring(cb, model=Estimating(), max_epochs=-1)
    assert cb.samples_seen == 300 and max(audit.errors) < 1e-5
    assert estimates == [math.ceil(300 / 8)]


@pytest.mark.parametrize("hold", [dict(min_epochs=4), dict(min_steps=10**6)])
def test_max_steps_ends_the_fit_whatever_min_epochs_or_min_steps_say(hold):
    # Lightning's `max_steps` ends a fit even where `min_epochs`/`min_steps` would hold it; SimiGrad counts it in
    # steps of B0 = 8 samples and ends the fit with `should_stop`, which those bounds used to hold back
    pl.seed_everything(0)
    plain = trainer(max_steps=20, max_epochs=6, **hold)
    plain.fit(BoringModel(), DataLoader(RandomDataset(32, 128), batch_size=8, shuffle=True))
    assert plain.global_step == 20  # 160 samples: into the second epoch
    cb = SimiGrad(target_similarity=0.95)
    t, model, audit = fit_boring(cb, max_steps=20, max_epochs=6, **hold)
    assert cb.samples_seen == 20 * 8 == sum(map(len, model.micro_batches))
    assert t.current_epoch == plain.current_epoch and max(audit.errors) < 1e-5
    cb = SimiGrad(target_similarity=0.95, max_samples=200)
    t, model, audit = fit_boring(cb, max_epochs=6, **hold)
    assert cb.samples_seen == 200 == sum(map(len, model.micro_batches))
    assert (t.fit_loop.min_epochs, t.min_steps) == (plain.fit_loop.min_epochs, plain.min_steps)  # restored


def test_accumulate_grad_batches_reads_the_window_length():
    seen = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(trainer.accumulate_grad_batches)

    cb = SimiGrad(target_similarity=0.95, initial_batch_size=24, max_micro_batch_size=8)
    pl.seed_everything(0)
    dataset = RandomDataset(32, 128)
    t = trainer(callbacks=[cb, Probe()], max_epochs=2)
    t.fit(BoringModel(), DataLoader(dataset, batch_size=8, shuffle=True))
    assert all(type(k) is int for k in seen)
    assert sorted(set(seen)) == sorted({int(h["accumulation"]) for h in cb.history})
    assert t.accumulate_grad_batches == 1  # the user's value again after fit


class AccumulationSchedule(pl.Callback):
    """A hand-written accumulation schedule, as users write before they find GradientAccumulationScheduler."""

    def on_train_epoch_start(self, trainer, pl_module):
        trainer.accumulate_grad_batches = 2 if trainer.current_epoch == 0 else 4


def test_a_callback_that_sets_accumulate_grad_batches_is_refused_before_the_first_step():
    # SimiGrad sets every window's accumulation: it would silently override the callback's
    model = BoringModel()
    t = trainer(callbacks=[SimiGrad(target_similarity=0.9), AccumulationSchedule()], max_epochs=2)
    with pytest.raises(RuntimeError, match=r"`trainer.accumulate_grad_batches` was set to 2 .*Remove what sets it"):
        t.fit(model)
    assert model.micro_batches == [] and t.global_step == 0
