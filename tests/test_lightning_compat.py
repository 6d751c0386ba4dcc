"""Ordinary Lightning code with SimiGrad added: modules written for plain Lightning, the Trainer paths users take.

Every test asserts a property that breaks if SimiGrad mishandles the path: the exact samples and gradient
of every step, a schedule that ends at its final value, a micro-batch BatchNorm accepts, what the
launching process sees after `ddp_spawn`, ...
"""

from __future__ import annotations

import copy
import csv
import json
import math
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import trainer
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.tuner import Tuner
from torch.nn import functional as F
from torch.utils.data import DataLoader
from user_modules import (
    BatchNormNet,
    BoringModel,
    ImagesDataModule,
    LitClassifier,
    RandomDataset,
    TransformerStyle,
)

from lightning_simigrad import SimiGrad
from lightning_simigrad.testing import StepAudit


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


class GradientAudit(StepAudit):
    """The reference harness, read as these tests read it: each step's samples, and its gradient's error."""

    def __init__(self, mean_loss) -> None:
        super().__init__(indices=lambda batch: batch[0].tolist(), mean_loss=mean_loss)

    @property
    def samples(self) -> list[list[int]]:
        return [step.samples for step in self.steps]

    @property
    def errors(self) -> list[float]:
        return [step.grad_rel_error for step in self.steps]


def boring_loss(dataset: RandomDataset):
    return lambda model, indices: model.loss(dataset.data[indices])


def fit_boring(cb: SimiGrad, model=None, dataset_length=128, batch_size=8, extra_callbacks=(), **trainer_kwargs):
    pl.seed_everything(0)
    dataset = RandomDataset(32, dataset_length)
    audit = GradientAudit(boring_loss(dataset))
    model = model or BoringModel()
    t = trainer(callbacks=[cb, audit, *extra_callbacks], **trainer_kwargs)
    t.fit(model, DataLoader(dataset, batch_size=batch_size, shuffle=True))
    return t, model, audit


# ---------------------------------------------------------------------------------------------- data
def test_a_datamodule_feeds_every_sample_once_per_epoch():
    pl.seed_everything(0)
    datamodule = ImagesDataModule(n=256, batch_size=16)
    model = LitClassifier()
    cb = SimiGrad(target_similarity=0.9, max_batch_size=96)
    t = trainer(callbacks=[cb], max_epochs=3)
    t.fit(model, datamodule=datamodule)
    seen = [i for m in model.micro_batches for i in m]
    train_indices = sorted(datamodule.train_set.indices)
    assert len(seen) == 3 * len(train_indices) == cb.samples_seen
    for epoch in range(3):
        part = seen[epoch * len(train_indices) : (epoch + 1) * len(train_indices)]
        assert sorted(part) == train_indices
    assert len({h["batch_size"] for h in cb.history}) > 2  # the batch moved
    assert sorted(model.validated) == sorted(list(datamodule.val_set.indices) * 3)  # validated once per epoch


def test_validate_test_and_predict_after_fit_see_their_whole_data():
    pl.seed_everything(0)
    datamodule = ImagesDataModule(n=128, batch_size=16)
    model = LitClassifier()
    cb = SimiGrad(target_similarity=0.9)
    t = trainer(callbacks=[cb], max_epochs=1)
    t.fit(model, datamodule=datamodule)
    model.validated = []
    t.validate(model, datamodule=datamodule, verbose=False)
    assert sorted(model.validated) == sorted(datamodule.val_set.indices)
    assert "test_acc" in t.test(model, datamodule=datamodule, verbose=False)[0]
    predicted = [i for idx, _ in t.predict(model, datamodule=datamodule) for i in idx.tolist()]
    assert sorted(predicted) == sorted(datamodule.val_set.indices)


@pytest.mark.parametrize("limit", [1, 2, 3, 4, 5, 6, 7, 8, 9])
def test_limit_train_batches_feeds_the_samples_of_its_batches_for_every_residue(limit):
    # windows of 32 samples (4 micro-batches of 8); limit k feeds the samples of k batches of 8 per epoch
    cb = SimiGrad(target_similarity=0.5, initial_batch_size=32, adjust=False)
    t, model, audit = fit_boring(cb, max_epochs=2, limit_train_batches=limit)
    per_epoch = 8 * limit
    seen = [i for s in audit.samples for i in s]
    assert len(seen) == 2 * per_epoch == cb.samples_seen
    assert len(set(seen[:per_epoch])) == per_epoch and len(set(seen[per_epoch:])) == per_epoch
    assert max(audit.errors) < 1e-5  # every step's gradient is the mean over exactly its samples
    assert all(len(m) >= 2 for m in model.micro_batches)  # no one-sample micro-batch at the cut


def test_fractional_limit_train_batches_feeds_that_fraction_of_the_samples():
    cb = SimiGrad(target_similarity=0.9)
    t, model, audit = fit_boring(cb, max_epochs=2, limit_train_batches=0.3)
    assert cb.samples_seen == 2 * int(128 * 0.3)
    assert max(audit.errors) < 1e-5


@pytest.mark.parametrize("fast_dev_run", [True, 5])
def test_fast_dev_run_trains_its_batches_exactly(fast_dev_run):
    cb = SimiGrad(target_similarity=0.9)
    t, model, audit = fit_boring(cb, fast_dev_run=fast_dev_run)
    batches = 1 if fast_dev_run is True else fast_dev_run
    assert cb.samples_seen == 8 * batches == len({i for s in audit.samples for i in s})
    assert max(audit.errors) < 1e-5
    assert all(p.grad is not None for p in model.parameters())  # no half of a window left aside


# ---------------------------------------------------------------------------------------------- schedules
def make_scheduler(optimizer, idiom: str, total: int):
    if idiom == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
    if idiom == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total, eta_min=1e-4)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / total))


class ScheduledBoring(BoringModel):
    """The common idioms: a step-interval schedule over `self.trainer.estimated_stepping_batches`."""

    def __init__(self, idiom: str) -> None:
        super().__init__()
        self.idiom = idiom

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = make_scheduler(optimizer, self.idiom, self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


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


# ---------------------------------------------------------------------------------------------- logging
def test_learning_rate_monitor_reports_the_applied_learning_rate(tmp_path):
    pl.seed_everything(0)
    model = TransformerStyle()
    cb = SimiGrad(target_similarity=0.95)
    t = trainer(
        callbacks=[LearningRateMonitor(logging_interval="step"), cb],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        max_epochs=2,
    )
    t.fit(model)
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    monitored = {int(r["step"]): float(r["lr-AdamW"]) for r in rows if r.get("lr-AdamW")}
    applied = {int(h["step"]): h["lr"] for h in cb.history}
    assert len(monitored) == t.global_step
    assert any(h["lr_scale"] > 1.5 for h in cb.history)
    for step, lr in monitored.items():
        assert lr == pytest.approx(applied[step], rel=1e-6)


# ---------------------------------------------------------------------------------------------- stopping
def test_early_stopping_stops_on_a_whole_window():
    pl.seed_everything(0)
    datamodule = ImagesDataModule(n=256, batch_size=16)
    model = LitClassifier(lr=0.05)
    images = IndexedImagesOf(datamodule)
    audit = GradientAudit(images.mean_loss)
    cb = SimiGrad(target_similarity=0.9)
    stop = EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)  # stops at the second check
    t = trainer(callbacks=[cb, audit, stop], max_epochs=20, val_check_interval=5)
    t.fit(model, datamodule=datamodule)
    assert t.should_stop
    # stopped within the first epoch at the second validation: after the step that crossed 2 x 5 batches of 16
    assert sum(map(len, audit.samples)) == cb.samples_seen
    assert 160 <= cb.samples_seen < 160 + cb.history[-1]["batch_size"] < len(datamodule.train_set)
    assert len(model.validated) == 2 * len(datamodule.val_set)
    assert max(audit.errors) < 1e-5


class IndexedImagesOf:
    def __init__(self, datamodule: ImagesDataModule) -> None:
        datamodule.setup("fit")
        self.dataset = datamodule.train_set.dataset

    def mean_loss(self, model, indices):
        return F.cross_entropy(model(self.dataset.images[indices]), self.dataset.labels[indices])


@pytest.mark.parametrize("stop", ["callback", "max_time"])
def test_a_stop_inside_a_window_leaves_the_gradient_whole(stop):
    class StopMidWindow(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 5:  # the 2nd micro-batch of the second window of 4
                trainer.should_stop = True

    pl.seed_everything(0)
    dataset = RandomDataset(32, 128)
    model = BoringModel()
    cb = SimiGrad(target_similarity=0.95, initial_batch_size=32, adjust=False)
    # max_time of a microsecond: Lightning's Timer stops the fit at the end of the first micro-batch
    flags = (
        dict(callbacks=[cb, StopMidWindow()])
        if stop == "callback"
        else dict(callbacks=[cb], max_time=timedelta(microseconds=1))
    )
    t = trainer(max_epochs=3, **flags)
    t.fit(model, DataLoader(dataset, batch_size=8, shuffle=True))
    fed = 6 if stop == "callback" else 1
    assert t.global_step == fed // 4 and cb.samples_seen == 32 * (fed // 4)
    # the unstepped window's micro-batches are whole in p.grad: (1/32) * the sum of their gradients
    unstepped = [i for m in model.micro_batches[4 * (fed // 4) : fed] for i in m]
    reference = copy.deepcopy(model)
    reference.zero_grad()
    (reference.loss(dataset.data[unstepped]) * len(unstepped) / 32).backward()
    grads, expected = flat([p.grad for p in model.parameters()]), flat([p.grad for p in reference.parameters()])
    torch.testing.assert_close(grads, expected)


# ---------------------------------------------------------------------------------------------- skipping
class SkippingBoring(BoringModel):
    """Returns None (Lightning's documented skip) for some micro-batches."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.skip = skip
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        if self.calls - 1 in self.skip:
            return None
        return super().training_step(batch, batch_idx)


def test_skipped_micro_batches_leave_every_step_a_mean_over_what_it_fed():
    # windows of 4 micro-batches: skip a first-half one, the set-aside point, and a window's last one
    model = SkippingBoring(skip={1, 5, 11, 12, 13})
    cb = SimiGrad(target_similarity=0.95, initial_batch_size=32, adjust=False)
    t, model, audit = fit_boring(cb, model=model, max_epochs=1)
    fed = [len(s) for s in audit.samples]
    assert [int(h["batch_size"]) for h in cb.history] == fed == [24, 24, 24, 16]
    assert max(audit.errors) < 1e-5  # nothing of a skipped window leaks into the next
    assert cb.samples_seen == 128 - 5 * 8
    measured = [math.isfinite(h["similarity"]) for h in cb.history]
    assert measured == [True, True, False, False]  # no last backward, or no first half: not measured


# ---------------------------------------------------------------------------------------------- validation
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


# ---------------------------------------------------------------------------------------------- checkpoints
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


# ---------------------------------------------------------------------------------------------- BatchNorm
@pytest.mark.parametrize("length,batch_size", [(35, 16), (33, 16), (129, 8), (17, 8)])
def test_batchnorm_never_sees_a_one_sample_micro_batch_plain_lightning_would_not_feed(length, batch_size):
    pl.seed_everything(0)
    model = BatchNormNet()
    cb = SimiGrad(target_similarity=0.9)
    t = trainer(callbacks=[cb], max_epochs=4)
    t.fit(model, DataLoader(RandomDataset(32, length), batch_size=batch_size, shuffle=True))  # crashes on a 1
    assert min(len(m) for m in model.micro_batches) >= 2
    assert cb.samples_seen == 4 * length


class RankDump(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        cb = next(c for c in trainer.callbacks if isinstance(c, SimiGrad))
        payload = dict(micro=pl_module.micro_batches, history=cb.history)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(payload))


@pytest.mark.timeout(120)
def test_batchnorm_tails_on_two_processes_and_ddp_spawn_results_reach_the_launching_process(tmp_path):
    pl.seed_everything(0)
    model = BatchNormNet()
    cb = SimiGrad(target_similarity=0.9)
    t = trainer(devices=2, strategy="ddp_spawn", max_epochs=3, callbacks=[cb, RankDump(tmp_path)])
    # plain Lightning: 19 samples per rank, fed as 8, 8, 3
    t.fit(model, DataLoader(RandomDataset(32, 37), batch_size=8, shuffle=True))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert min(len(m) for r in ranks for m in r["micro"]) >= 2
    assert sorted(i for r in ranks for m in r["micro"] for i in m) == sorted(list(range(37)) * 3)
    # the SimiGrad object the user holds has the fit's results, as after a fit in one process
    assert cb.history == ranks[0]["history"] and len(cb.history) > 0
    assert cb.samples_seen == 3 * 37 and cb.steps == len(cb.history)
    assert cb.batch_size is not None and cb.controller is not None
    assert cb.controller.measured_steps >= len(cb.history) - 3


# ---------------------------------------------------------------------------------------------- tuners
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


# ---------------------------------------------------------------------------------------------- LightningCLI
def test_lightning_cli_configures_simigrad_from_yaml_and_the_command_line(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "simigrad.yaml"
    config.write_text(
        "trainer:\n"
        "  max_epochs: 2\n  logger: false\n  enable_checkpointing: false\n  enable_progress_bar: false\n"
        "  accelerator: cpu\n  devices: 1\n"
        "  callbacks:\n"
        "    - class_path: lightning_simigrad.SimiGrad\n"
        "      init_args:\n        target_similarity: 0.9\n        max_batch_size: 64\n"
    )
    cli = LightningCLI(
        LitClassifier,
        ImagesDataModule,
        args=[
            "fit",
            "--config",
            str(config),
            "--trainer.callbacks.init_args.target_similarity=0.95",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        seed_everything_default=0,
    )
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, SimiGrad)]
    assert cb.target_similarity == 0.95 and cb.controller.max_batch_size == 64
    assert cb.samples_seen == 2 * len(cli.datamodule.train_set)
    assert max(h["batch_size"] for h in cb.history) > 16

    cli = LightningCLI(
        LitClassifier,
        ImagesDataModule,
        args=[
            "fit",
            "--trainer.max_epochs=1",
            "--trainer.logger=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.callbacks+=lightning_simigrad.SimiGrad",
            "--trainer.callbacks.target_similarity=0.8",
            "--trainer.callbacks.max_samples=100",
            f"--trainer.default_root_dir={tmp_path / 'second'}",
        ],
        seed_everything_default=0,
    )
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, SimiGrad)]
    assert cb.target_similarity == 0.8 and cb.samples_seen == 100


# ---------------------------------------------------------------------------------------------- everyday flags
@pytest.mark.parametrize(
    "flags,per_epoch,first_step",
    [
        (dict(accumulate_grad_batches=3), 128, 24),  # B0 = 8 x 3: the user's accumulation sets the first batch
        (dict(overfit_batches=2), 16, 8),  # the same first 2 batches of samples every epoch, in order
        (dict(reload_dataloaders_every_n_epochs=1), 128, 8),
        (dict(deterministic=True, gradient_clip_val=0.5, log_every_n_steps=1), 128, 8),
    ],
)
def test_everyday_trainer_flags_keep_every_step_exact(flags, per_epoch, first_step):
    cb = SimiGrad(target_similarity=0.95)
    t, model, audit = fit_boring(cb, max_epochs=3, **flags)
    seen = [i for s in audit.samples for i in s]
    assert cb.samples_seen == len(seen) == 3 * per_epoch
    for epoch in range(3):
        assert len(set(seen[epoch * per_epoch : (epoch + 1) * per_epoch])) == per_epoch
    if "overfit_batches" in flags:
        assert sorted(set(seen)) == list(range(16))
    assert cb.history[0]["batch_size"] == first_step
    assert max(audit.errors) < 1e-5  # (before clipping, which Lightning applies after on_before_optimizer_step)


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


# ----- round 2: paths where SimiGrad changed what Lightning does (issue 17) -----
# Each test runs the user's setup once as plain Lightning (a fixed batch) and once with SimiGrad, and asserts
# that SimiGrad keeps what Lightning does: counts, gradients, learning rates, validations per epoch.
class AbandonsTheEpoch(BoringModel):
    """Ends epoch 0 at micro-batch ``at`` in one of the ways Lightning ends an epoch early."""

    def __init__(self, how: str, at: int) -> None:
        super().__init__()
        self.how, self.at = how, at

    def on_train_batch_start(self, batch, batch_idx):
        if self.how == "return -1" and self.current_epoch == 0 and batch_idx == self.at:
            return -1  # Lightning's documented "skip the rest of the epoch"
        return None

    def training_step(self, batch, batch_idx):
        if self.how == "StopIteration in training_step" and self.current_epoch == 0 and batch_idx == self.at:
            raise StopIteration  # e.g. `next()` on an exhausted iterator of the user's own
        return super().training_step(batch, batch_idx)


class StopIterationAfterBatch(pl.Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == self.at:
            raise StopIteration


@pytest.mark.parametrize(
    "how,at",
    [
        ("return -1", 7),  # the last micro-batch of the second window of 4: its first half is set aside
        ("StopIteration in training_step", 7),
        ("StopIteration in a callback", 6),  # after the backward of the second half's first micro-batch
    ],
)
def test_a_window_abandoned_at_the_epochs_end_is_dropped_as_lightning_drops_it(how, at):
    def run(simigrad: bool):
        pl.seed_everything(0)
        dataset = RandomDataset(32, 128)
        model = AbandonsTheEpoch(how, at)
        audit = GradientAudit(boring_loss(dataset))  # forgets a window abandoned at an epoch's end, as Lightning
        callbacks = [audit] + ([StopIterationAfterBatch(at)] if how == "StopIteration in a callback" else [])
        if simigrad:
            cb = SimiGrad(target_similarity=0.95, initial_batch_size=32, adjust=False, lr_scaling="none")
            t = trainer(callbacks=[cb, *callbacks], max_epochs=2)
        else:
            t = trainer(callbacks=callbacks, max_epochs=2, accumulate_grad_batches=4)
        t.fit(model, DataLoader(dataset, batch_size=8, shuffle=True))
        return t, audit

    plain, plain_audit = run(simigrad=False)
    t, audit = run(simigrad=True)
    assert t.global_step == plain.global_step == 1 + 4  # the abandoned window never stepped
    assert [len(s) for s in audit.samples] == [len(s) for s in plain_audit.samples] == [32] * 5
    assert max(plain_audit.errors) < 1e-5
    # the next epoch's first step is the mean over its own samples: nothing of the abandoned window leaks in
    assert max(audit.errors) < 1e-5


class LossRecording(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.losses.append(float(out["loss"]))
        return out


class OutputsLoss(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_outputs_loss_is_the_micro_batchs_own_mean_loss():
    probe = OutputsLoss()
    cb = SimiGrad(target_similarity=0.95, max_micro_batch_size=8)
    t, model, audit = fit_boring(cb, model=LossRecording(), max_epochs=3, extra_callbacks=[probe])
    assert len({int(h["accumulation"]) for h in cb.history}) > 1  # windows of several lengths
    # what plain Lightning hands callbacks without accumulation: the loss training_step returned
    assert probe.losses == pytest.approx(model.losses, rel=1e-6)
    assert max(audit.errors) < 1e-5  # while the backward still weighs every sample of a step by 1 / batch size


def test_spike_detection_sees_no_spike_on_a_smooth_run(tmp_path):
    from lightning.pytorch.callbacks.spike import SpikeDetection

    def run(simigrad: bool):
        pl.seed_everything(0)
        datamodule = ImagesDataModule(n=256, batch_size=16)
        spikes = SpikeDetection(exclude_batches_path=tmp_path / f"skip{simigrad}.json")
        callbacks = [SimiGrad(target_similarity=0.9), spikes] if simigrad else [spikes]
        t = trainer(callbacks=callbacks, max_epochs=4)
        t.fit(LitClassifier(), datamodule=datamodule)
        return t

    assert run(simigrad=False).current_epoch == 4
    assert run(simigrad=True).current_epoch == 4  # no TrainingSpikeException


class StepsPerEpoch(pl.Callback):
    def __init__(self) -> None:
        self.steps: dict[int, int] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps[trainer.current_epoch] = self.steps.get(trainer.current_epoch, 0) + 1


class ValidatedBatchNorm(BatchNormNet):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.net(batch[1]).pow(2).mean())

    def val_dataloader(self):
        return DataLoader(RandomDataset(32, 16), batch_size=8)


def test_stochastic_weight_averagings_batchnorm_epoch_takes_no_optimizer_step():
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    def run(simigrad: bool):
        pl.seed_everything(0)
        model = ValidatedBatchNorm()
        swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2)
        steps, validations = StepsPerEpoch(), ValidationsPerEpoch()
        callbacks = [swa, steps, validations] + ([SimiGrad(target_similarity=0.9)] if simigrad else [])
        t = trainer(callbacks=callbacks, max_epochs=4)
        t.fit(model, DataLoader(RandomDataset(32, 64), batch_size=8, shuffle=True))
        return model, swa, steps.steps, validations.per_epoch

    _, _, plain_steps, plain_validations = run(simigrad=False)
    assert sorted(plain_steps) == [0, 1, 2, 3, 4]  # SWA adds a fifth epoch, for BatchNorm's statistics
    model, swa, steps, validations = run(simigrad=True)
    assert sorted(steps) == [0, 1, 2, 3]  # the fifth ran no backward: nothing to step
    assert validations == plain_validations == {epoch: 1 for epoch in range(5)}  # validated after it, too
    # the model holds the averaged weights SWA transferred, untouched ...
    for p, averaged in zip(model.parameters(), swa._average_model.parameters()):
        torch.testing.assert_close(p.detach(), averaged.detach(), rtol=0, atol=0)
    # ... and BatchNorm's statistics are the plain average over the epoch's micro-batches, at those weights
    bn = model.net[1]
    data = RandomDataset(32, 64).data
    last_epoch = model.micro_batches[-int(bn.num_batches_tracked) :]
    assert sorted(i for m in last_epoch for i in m) == list(range(64))
    with torch.no_grad():
        means = torch.stack([model.net[0](data[m]).mean(0) for m in last_epoch]).mean(0)
    torch.testing.assert_close(bn.running_mean, means)


class FrequencyTwo(BoringModel):
    """A step-interval scheduler stepped every second batch (Lightning counts the batches within each epoch)."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 2}}


class AppliedLRs(pl.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.at_epoch_end: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def on_train_epoch_end(self, trainer, pl_module):
        self.at_epoch_end.append(trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0])


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


class ValidationsPerEpoch(pl.Callback):
    def __init__(self) -> None:
        self.per_epoch: dict[int, int] = {}
        self.inside_a_window = 0

    def on_validation_start(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        self.per_epoch[trainer.current_epoch] = self.per_epoch.get(trainer.current_epoch, 0) + 1
        cb = next((c for c in trainer.callbacks if isinstance(c, SimiGrad)), None)
        if cb is not None and cb.schedule.current.inside_window:
            self.inside_a_window += 1


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
