"""Checkpoints carry SimiGrad's state: a resumed run continues the uninterrupted run step for step, and a
checkpoint it cannot resume faithfully is refused before the first step.

The uninterrupted run writes a checkpoint after every optimizer step; runs resumed from several of them (in
the middle of an epoch, in the middle of a window, at an epoch's last step) must log the same rows, train the
same samples in the same steps and end with bitwise the same weights. The model uses dropout, so this holds
only if the checkpoint also restores the random generators where the uninterrupted run drew next.
"""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, WeightedRandomSampler

from lightning_simigrad import SimiGrad
from tests.support.helpers import IndexedRegression, Regressor, StepSamples, trainer

N = 300  # training samples: windows of 16 to 150 make epochs of 6 to 19 steps


class SaveInsideWindow(pl.Callback):
    """Writes ``path`` after the first micro-batch of the window that follows optimizer step ``step``."""

    def __init__(self, path, step: int) -> None:
        self.path, self.step, self.micro_batches_after = path, step, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.micro_batches_after += 1  # the first is the micro-batch that stepped
            if self.micro_batches_after == 2:
                trainer.save_checkpoint(self.path)


def run(root, ckpt_path=None, workers=0, max_epochs=2, n=N, callbacks=(), scheduler=False):
    pl.seed_everything(0)
    model = Regressor(scheduler=scheduler, dropout=0.2)  # its steps draw random numbers: the checkpoint keeps them
    cb = SimiGrad(target_similarity=0.9, smoothing=0.5, max_batch_size=150)
    steps = StepSamples()
    every_step = ModelCheckpoint(dirpath=root, filename="{step}", save_top_k=-1, every_n_train_steps=1, save_last=True)
    t = trainer(callbacks=[cb, every_step, steps, *callbacks], max_epochs=max_epochs, enable_checkpointing=True)
    loader = DataLoader(
        IndexedRegression(n), batch_size=16, shuffle=True, num_workers=workers, persistent_workers=workers > 0
    )
    t.fit(model, loader, ckpt_path=ckpt_path)
    return cb, steps.steps, model


def rows(history) -> list[str]:
    return [repr(sorted(h.items())) for h in history]  # repr: NaN compares equal to NaN


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_run_reproduces_the_uninterrupted_run_step_for_step(tmp_path, workers):
    whole, whole_steps, whole_model = run(tmp_path / "whole", workers=workers)
    epoch_end = next(k for k, h in enumerate(whole.history, 1) if h["samples_seen"] == N)
    assert 4 < epoch_end < len(whole.history) - 2
    for k in (4, epoch_end, epoch_end + 2):  # mid-epoch, after an epoch's last step, early in the next epoch
        checkpoint = tmp_path / "whole" / f"step={k}.ckpt"
        resumed, steps, model = run(tmp_path / f"from{k}", ckpt_path=checkpoint, workers=workers)
        # the same batch sizes, similarities, learning rates, noise scales ... from step k on
        assert rows(resumed.history) == rows(whole.history[k:]), k
        assert steps == whole_steps[k:]  # every step averaged the same samples
        assert_same_weights(model, whole_model)
    assert len({h["batch_size"] for h in whole.history}) > 5  # the batch moved: the trajectory was at stake


@pytest.mark.timeout(300)
def test_a_checkpoint_written_inside_a_window_retrains_that_window_from_its_start(tmp_path):
    inside = tmp_path / "inside.ckpt"
    whole, whole_steps, whole_model = run(tmp_path / "whole", callbacks=[SaveInsideWindow(inside, step=5)])
    checkpoint = torch.load(inside, weights_only=False)
    state = checkpoint["callbacks"]["SimiGrad"]
    assert state["counts"]["steps"] == 5 and state["schedule"]["planned"][0] == whole.history[5]["batch_size"]
    assert checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"] == sum(
        h["accumulation"] for h in whole.history[:5]
    )  # written one micro-batch into window 5 (Lightning counts it completed only after its hooks)
    resumed, steps, model = run(tmp_path / "resumed", ckpt_path=inside)
    # the half-trained window's samples count once, in the step that commits them after the resume
    assert rows(resumed.history) == rows(whole.history[5:])
    assert steps == whole_steps[5:]
    assert_same_weights(model, whole_model)


@pytest.mark.timeout(300)
def test_resume_at_an_epoch_end_continues_the_same_run(tmp_path):
    whole, _, _ = run(tmp_path / "whole", max_epochs=4)
    part, _, _ = run(tmp_path / "part", max_epochs=2)
    state = torch.load(tmp_path / "part" / "last.ckpt", weights_only=False)["callbacks"]["SimiGrad"]
    assert state["schedule"]["batch_size"] == part.batch_size
    assert state["counts"]["samples_seen"] == 2 * N
    assert state["controller"] == part.controller.state_dict()
    resumed, _, _ = run(tmp_path / "part", max_epochs=4, ckpt_path=tmp_path / "part" / "last.ckpt")
    assert rows(part.history + resumed.history) == rows(whole.history)
    assert resumed.controller.state_dict() == whole.controller.state_dict()


# ---------------------------------------------------------------------------------------------- honest checkpoints
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A fit's checkpoints: ``step=4.ckpt`` is in the middle of the first epoch."""
    root = tmp_path_factory.mktemp("source")
    run(root, max_epochs=1)
    return root


def resume_with_state(tmp_path, source, change, model, **simigrad):
    """Fits ``model`` from ``source`` with its SimiGrad state changed by ``change``."""
    checkpoint = torch.load(source, weights_only=False)
    change(checkpoint["callbacks"])
    path = tmp_path / "changed.ckpt"
    torch.save(checkpoint, path)
    pl.seed_everything(0)
    t = trainer(callbacks=[SimiGrad(target_similarity=0.9, **simigrad)], max_epochs=1)
    t.fit(model, DataLoader(IndexedRegression(N), batch_size=16, shuffle=True), ckpt_path=path)


def set_field(name, value):
    def change(callbacks):
        state, *path = callbacks["SimiGrad"], *name.split(".")
        for key in path[:-1]:
            state = state[key]
        state[path[-1]] = value

    return change


def drop_field(name):
    return lambda callbacks: callbacks["SimiGrad"].pop(name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "change,message",
    [
        (
            set_field("format_version", 99),
            "`format_version` 99; this lightning_simigrad reads formats 1 and 2. Upgrade",
        ),
        (drop_field("format_version"), "has no `format_version`"),
        (set_field("schedule.batch_size", -3), "`schedule.batch_size` = -3, which must be a positive int"),
        (drop_field("controller"), "lacks `controller`"),
        (set_field("controller.size", math.nan), "`controller.size` = nan"),
        (
            set_field("schedule.planned", ["16"]),
            "`schedule.planned` = \\['16'\\], which must be a list of positive ints",
        ),
        (
            set_field("counts.epoch_samples_done", 10**6),
            "inconsistent: `counts.epoch_samples_done` \\(1000000\\) exceeds",
        ),
        (lambda callbacks: callbacks.update(SimiGrad=[1, 2]), "is a `list`, not a dict"),
        (
            lambda callbacks: callbacks["SimiGrad"]["rng"][0].pop("python"),
            "lacks `rng\\[0\\].python`, rank 0's Python `random` state",
        ),
        (
            lambda callbacks: callbacks["SimiGrad"]["rng"][0].update(torch=bytes(10)),
            "`rng\\[0\\].torch` = b'.*' \\(10 bytes\\): rank 0's torch CPU generator state must be 5056 bytes",
        ),
        (
            lambda callbacks: callbacks["SimiGrad"]["rng"][0]["numpy"].__setitem__(1, [7] * 5),
            "`rng\\[0\\].numpy` = .*: rank 0's NumPy global generator state must be a list",
        ),
    ],
    ids=[
        *("newer", "unversioned", "negative", "missing", "nan", "wrong-type", "inconsistent", "not-a-dict"),
        *("rng-missing", "rng-torch-size", "rng-numpy-keys"),
    ],
)
def test_a_malformed_or_incompatible_state_is_refused_before_training(tmp_path, checkpoints, change, message):
    model = Regressor(dropout=0.2)
    with pytest.raises(ValueError, match=message) as info:
        resume_with_state(tmp_path, checkpoints / "step=4.ckpt", change, model)
    assert "changed.ckpt" in str(info.value)  # names the file
    assert model.micro_batches == []  # the refused fit trained no micro-batch


class SaveAtTrainStart(pl.Callback):
    """Writes ``path`` before the first batch, and ends the fit there."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)
        trainer.should_stop = True


@pytest.mark.timeout(300)
def test_a_checkpoint_written_after_a_resume_before_the_first_batch_keeps_the_generators_to_restore(
    tmp_path, checkpoints
):
    source = torch.load(checkpoints / "step=4.ckpt", weights_only=False)["callbacks"]["SimiGrad"]
    pl.seed_everything(1)  # other generator states than those the checkpoint holds
    cb = SimiGrad(target_similarity=0.9, max_batch_size=150)
    t = trainer(callbacks=[cb, SaveAtTrainStart(tmp_path / "again.ckpt")], max_epochs=1)
    model = Regressor(dropout=0.2)
    t.fit(model, DataLoader(IndexedRegression(N), batch_size=16, shuffle=True), ckpt_path=checkpoints / "step=4.ckpt")
    assert model.micro_batches == []
    again = torch.load(tmp_path / "again.ckpt", weights_only=False)["callbacks"]["SimiGrad"]
    assert again["rng"] == source["rng"]  # restored at the first batch, which this fit never reached
    assert cb.run.resumption.states is None  # and forgotten when the fit ended


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bound", ["max_batch_size", "min_batch_size"])
def test_bounds_changed_at_resume_hold_from_the_first_step_with_one_warning(checkpoints, bound):
    state = torch.load(checkpoints / "step=4.ckpt", weights_only=False)["callbacks"]["SimiGrad"]
    sizes = [state["schedule"]["batch_size"], *state["schedule"]["planned"]]
    # lowered below (as after an out-of-memory error), or raised above, every size the checkpoint asks for
    value = min(sizes) - 3 if bound == "max_batch_size" else max(sizes) + 3
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.9, **{bound: value})
    t = trainer(callbacks=[cb], max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(
            Regressor(dropout=0.2),
            DataLoader(IndexedRegression(N), batch_size=16, shuffle=True),
            ckpt_path=checkpoints / "step=4.ckpt",
        )
    # the epoch's last window takes what is left, or shares it with the window before
    trained = [h["batch_size"] for h in cb.history[:-2]]
    assert trained and all(size <= value if bound == "max_batch_size" else size >= value for size in trained)
    (warning,) = [str(w.message) for w in caught if "outside this fit's bounds" in str(w.message)]
    assert "differs from the uninterrupted one" in warning


def older_noise_averages(prefix):
    """The controller state as earlier writers of format 1 wrote it: raw averages (prefix ""), later averages relative
    to each step's own gradient size (prefix "relative_")."""

    def edit(callbacks):
        controller = callbacks["SimiGrad"]["controller"]
        del controller["reference"], controller["referenced_grad_sq_square_ema"]
        for name in ("grad_sq_ema", "trace_sigma_ema"):
            controller[f"{prefix}{name}"] = controller.pop(f"referenced_{name}")

    return edit


raw_noise_averages = older_noise_averages("")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("prefix", ["", "relative_"])
def test_an_earlier_writers_noise_averages_are_accepted_and_start_afresh(tmp_path, checkpoints, prefix):
    model = Regressor(dropout=0.2)
    resume_with_state(tmp_path, checkpoints / "step=4.ckpt", older_noise_averages(prefix), model)
    assert model.micro_batches  # the resumed fit trained

    # ... and a damaged value under the earlier name is refused, naming it
    def damaged(callbacks):
        raw_noise_averages(callbacks)
        callbacks["SimiGrad"]["controller"]["grad_sq_ema"] = [math.nan, 1.0]

    with pytest.raises(ValueError, match="`controller.grad_sq_ema` = \\[nan, 1.0\\]"):
        resume_with_state(tmp_path, checkpoints / "step=4.ckpt", damaged, Regressor(dropout=0.2))


@pytest.mark.timeout(300)
def test_a_mid_epoch_checkpoint_of_another_training_set_is_refused(checkpoints):
    pl.seed_everything(0)
    model = Regressor(dropout=0.2)
    t = trainer(callbacks=[SimiGrad(target_similarity=0.9)], max_epochs=1)
    loader = DataLoader(IndexedRegression(N - 10), batch_size=16, shuffle=True)
    with pytest.raises(ValueError, match="epoch 0 of a training set of 300 samples; this fit's training set has 290"):
        t.fit(model, loader, ckpt_path=checkpoints / "step=4.ckpt")
    assert model.micro_batches == []


@pytest.mark.timeout(300)
def test_a_mid_epoch_resume_with_a_sampler_whose_order_cannot_be_regenerated_warns_once(checkpoints):
    pl.seed_everything(0)
    weighted = WeightedRandomSampler(torch.ones(N), num_samples=N)  # drawn with replacement: a new order each time
    loader = DataLoader(IndexedRegression(N), batch_size=16, sampler=weighted)
    t = trainer(callbacks=[SimiGrad(target_similarity=0.9, max_batch_size=150)], max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(Regressor(dropout=0.2), loader, ckpt_path=checkpoints / "step=4.ckpt")
    (warning,) = [str(w.message) for w in caught if "cannot regenerate" in str(w.message)]
    assert "middle of epoch 0" in warning and "`WeightedRandomSampler`" in warning


@pytest.mark.timeout(300)
def test_a_checkpoint_without_simigrad_state_resumes_at_b0_with_one_warning(tmp_path):
    pl.seed_everything(0)
    plain = trainer(
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)], max_epochs=1, enable_checkpointing=True
    )
    plain.fit(Regressor(scheduler=True), DataLoader(IndexedRegression(N), batch_size=16, shuffle=True))
    plain_steps = plain.global_step  # 19 steps of 16 samples
    restored_lr = plain.lr_scheduler_configs[0].scheduler.get_last_lr()[0]

    model = Regressor(scheduler=True)
    cb = SimiGrad(target_similarity=0.9, max_batch_size=150)
    t = trainer(callbacks=[cb], max_epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(model, DataLoader(IndexedRegression(N), batch_size=16, shuffle=True), ckpt_path=tmp_path / "last.ckpt")
    (warning,) = [str(w.message) for w in caught if "has no SimiGrad state" in str(w.message)]
    assert "restarts" not in warning  # written at the epoch's end: the next epoch starts as it would have
    first = cb.history[0]
    assert first["batch_size"] == 16 and first["step"] == plain_steps  # B0, counted on from the checkpoint
    assert first["samples_seen"] == (plain_steps + 1) * 16
    assert first["lr"] == pytest.approx(restored_lr)  # the restored schedule continues where it was
    assert sorted(i for m in model.micro_batches for i in m) == list(range(N))  # the second epoch, once each


# ---------------------------------------------------------------------------------------------- skipped micro-batches
class SkipFirst(Regressor):
    """Returns None (Lightning's skip) for the fit's first micro-batch, whose samples the sampler drew all the same."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if len(self.micro_batches) == 1 else loss


class StopAfter(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.should_stop = True  # after the checkpoint callback (listed before) has saved this step


@pytest.mark.timeout(300)
def test_a_skipped_micro_batch_does_not_shift_where_a_mid_epoch_resume_starts(tmp_path):
    pl.seed_everything(0)
    first = SkipFirst()
    every_step = ModelCheckpoint(dirpath=tmp_path, filename="{step}", save_top_k=-1, every_n_train_steps=1)
    cb = SimiGrad(target_similarity=0.9, max_batch_size=150)
    t = trainer(callbacks=[cb, every_step, StopAfter(4)], max_epochs=1, enable_checkpointing=True)
    t.fit(first, DataLoader(IndexedRegression(N), batch_size=16, shuffle=True))
    second = Regressor()
    t = trainer(callbacks=[SimiGrad(target_similarity=0.9, max_batch_size=150)], max_epochs=1)
    t.fit(second, DataLoader(IndexedRegression(N), batch_size=16, shuffle=True), ckpt_path=tmp_path / "step=4.ckpt")
    # across the two runs every sample of the epoch reached `training_step` exactly once
    fed = [i for m in first.micro_batches + second.micro_batches for i in m]
    assert sorted(fed) == list(range(N))
    # the epoch's position is where the sampler stands (the skipped samples were drawn); samples seen count what
    # was fed
    state = torch.load(tmp_path / "step=4.ckpt", weights_only=False)["callbacks"]["SimiGrad"]
    skipped = len(first.micro_batches[0])
    counts = state["counts"]
    assert counts["epoch_samples_done"] == sum(len(m) for m in first.micro_batches) == counts["samples_seen"] + skipped


@pytest.mark.timeout(300)
def test_a_mid_epoch_checkpoint_without_simigrad_state_says_that_the_epoch_restarts(tmp_path):
    pl.seed_everything(0)
    every_4 = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    plain = trainer(callbacks=[every_4], max_epochs=1, enable_checkpointing=True)
    plain.fit(Regressor(), DataLoader(IndexedRegression(N), batch_size=16, shuffle=True))

    model = Regressor()
    t = trainer(callbacks=[SimiGrad(target_similarity=0.9, max_batch_size=150)], max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(model, DataLoader(IndexedRegression(N), batch_size=16, shuffle=True), ckpt_path=tmp_path / "step=4.ckpt")
    (warning,) = [str(w.message) for w in caught if "has no SimiGrad state" in str(w.message)]
    assert "written 4 batches into epoch 0" in warning and "epoch 0 restarts from its first sample" in warning
    assert sorted(i for m in model.micro_batches for i in m) == list(range(N))  # the whole epoch, once


@pytest.mark.timeout(300)
def test_a_checkpoint_inside_an_epochs_shared_tail_resumes_exactly_under_a_min_batch_size(tmp_path):
    """The epoch's last two windows share what is left (here 12 and 12 of 104 samples after four windows of 20), so
    the first share lies below ``min_batch_size``; a checkpoint written inside it asks for the share again, and the
    resumed run must plan it as it was, not raise it to the bound (which would train 16 and then 8)."""

    def fit(root, callbacks=(), ckpt_path=None):
        pl.seed_everything(0)
        model = Regressor(dropout=0.2)
        cb = SimiGrad(target_similarity=0.5, adjust=False, initial_batch_size=20, min_batch_size=16)
        steps = StepSamples()
        t = trainer(callbacks=[cb, steps, *callbacks], max_epochs=1)
        t.fit(model, DataLoader(IndexedRegression(104), batch_size=20, shuffle=True), ckpt_path=ckpt_path)
        return cb, steps.steps, model

    whole, whole_steps, whole_model = fit(tmp_path / "whole", [SaveInsideWindow(tmp_path / "tail.ckpt", 4)])
    assert [len(s) for s in whole_steps] == [20] * 4 + [12, 12]
    state = torch.load(tmp_path / "tail.ckpt", weights_only=False)["callbacks"]["SimiGrad"]
    assert state["schedule"]["planned"][0] == 12  # written inside the tail's first share
    resumed, resumed_steps, resumed_model = fit(tmp_path / "resumed", ckpt_path=tmp_path / "tail.ckpt")
    assert resumed_steps == whole_steps[4:]
    assert rows(resumed.history) == rows(whole.history[4:])
    assert_same_weights(resumed_model, whole_model)
