"""BatchSizeSchedule: every step the size its schedule gives for the samples before it, exactly its samples' mean.

On one process with DataLoader workers (windows planned ahead of training) and on two DDP ranks (gloo), with a
function and with a dict; a mid-epoch resume continues step for step. Only an epoch's last two windows may differ
from the schedule: they share what the epoch has left.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_simigrad import BatchSizeSchedule, SimiGrad, doubling, linear_ramp
from tests.support.distributed import run_ok
from tests.support.fsdp_modules import as_external_process
from tests.support.helpers import IndexedRegression, Regressor, step_audit, trainer

N = 150  # samples per epoch
EPOCHS = 2
SCHEDULES = {
    "function": lambda: linear_ramp(start=8, end=40, over=200),
    "dict": lambda: {0: 8, 60: 16, 150: 24, 220: 40},
}


def check_steps(sizes: list[int], schedule, samples: list[list[int]] | None = None) -> None:
    """Every step's size is the schedule's for the samples before it, but an epoch's last two windows."""
    before, epoch_of = 0, []
    for size in sizes:
        epoch_of.append(before // N)
        before += size
    assert before == EPOCHS * N  # every sample of every epoch trained
    last_two = {i for e in range(EPOCHS) for i in [j for j, k in enumerate(epoch_of) if k == e][-2:]}
    before = 0
    for i, size in enumerate(sizes):
        if i not in last_two:
            assert size == schedule(before), (i, before, size)
        before += size
    if samples is not None:  # each sample once per epoch
        flat = [s for step in samples for s in step]
        for e in range(EPOCHS):
            assert sorted(flat[e * N : (e + 1) * N]) == list(range(N))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", sorted(SCHEDULES))
def test_one_process_with_workers_follows_the_schedule_exactly(kind: str) -> None:
    pl.seed_everything(0)
    dataset = IndexedRegression(N)
    cb = BatchSizeSchedule(SCHEDULES[kind](), max_micro_batch_size=8)
    audit = step_audit(dataset)
    t = trainer(callbacks=[cb, audit], max_epochs=EPOCHS)
    t.fit(Regressor(), DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2, persistent_workers=True))
    sizes = [len(step.samples) for step in audit.steps]
    check_steps(sizes, cb.settings.schedule, [step.samples for step in audit.steps])
    assert [row["batch_size"] for row in cb.history] == sizes  # what it logs is what it trained
    assert len(set(sizes)) >= 3  # the schedule moved the batch
    assert max(step.grad_rel_error for step in audit.steps) < 1e-12  # the mean over exactly its samples
    assert all(row["similarity"] == row["similarity"] for row in cb.history[:3])  # measured and logged (not NaN)


def _ddp_fit(rank: int, world: int, kind: str) -> dict:
    as_external_process(rank, world)
    pl.seed_everything(0)
    dataset = IndexedRegression(N)
    cb = BatchSizeSchedule(SCHEDULES[kind](), max_micro_batch_size=4)
    audit = step_audit(dataset)
    t = trainer(devices=world, strategy=DDPStrategy(process_group_backend="gloo"), max_epochs=EPOCHS,
                callbacks=[cb, audit])  # fmt: skip
    t.fit(Regressor(), DataLoader(dataset, batch_size=4, shuffle=True))
    return dict(
        samples=[step.samples for step in audit.steps],
        errors=[step.grad_rel_error for step in audit.steps],
        identical=all(step.ranks_identical for step in audit.steps),
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", sorted(SCHEDULES))
def test_two_ddp_ranks_follow_the_schedule_exactly(kind: str) -> None:
    ranks = run_ok(_ddp_fit, 2, kind, deadline_s=240)
    assert ranks[0]["samples"] == ranks[1]["samples"]  # both ranks audited the same steps
    samples = ranks[0]["samples"]
    check_steps([len(s) for s in samples], BatchSizeSchedule(SCHEDULES[kind]()).settings.schedule, samples)
    assert max(ranks[0]["errors"]) < 1e-12 and ranks[0]["identical"]


class SaveAtStep(pl.Callback):
    def __init__(self, path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not getattr(self, "saved", False):
            self.saved = True
            trainer.save_checkpoint(self.path)


@pytest.mark.timeout(300)
def test_a_mid_epoch_resume_continues_step_for_step(tmp_path) -> None:
    def fit(callbacks, ckpt_path=None):
        pl.seed_everything(0)
        cb = BatchSizeSchedule(doubling(8, at=[40, 120]), max_micro_batch_size=8)
        model = Regressor()
        t = trainer(callbacks=[cb, *callbacks], max_epochs=EPOCHS)
        t.fit(model, DataLoader(IndexedRegression(N), batch_size=8, shuffle=True), ckpt_path=ckpt_path)
        return cb, model

    whole, whole_model = fit([SaveAtStep(tmp_path / "mid.ckpt", step=5)])
    state = torch.load(tmp_path / "mid.ckpt", weights_only=False)["callbacks"]["BatchSizeSchedule"]
    assert 0 < state["counts"]["epoch_samples_done"] < N
    resumed, resumed_model = fit([], ckpt_path=tmp_path / "mid.ckpt")
    rows = [(r["step"], r["batch_size"], r["samples_seen"]) for r in whole.history]
    assert [(r["step"], r["batch_size"], r["samples_seen"]) for r in resumed.history] == rows[5:]
    for p, q in zip(whole_model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("schedule", "arguments", "message"),
    [
        ({0: 0}, {}, r"gives 0 at 0: a batch size must be a positive int"),
        ({10: 8}, {}, r"gives no batch size for the first step: add the key 0"),
        ({0: 8, -1: 16}, {}, r"has the key -1: keys are the samples trained, non-negative ints"),
        ({0: 8, 100: 512}, {"max_batch_size": 256}, r"gives 512 at 100 samples trained, outside"),
        (lambda trained: 2.5, {}, r"gave 2.5 for 0 samples trained: a batch size must be a positive int"),
        ("ramp", {}, r"`schedule` = 'ramp' is a `str`; pass a function"),
        ({0: 8}, {"target_similarity": 0.8}, r"unexpected argument\(s\) target_similarity"),
    ],
    ids=["zero", "no-start", "negative-key", "above-max", "not-an-int", "not-a-schedule", "controller-argument"],
)
def test_a_bad_schedule_is_refused_at_construction_with_the_fix(schedule, arguments, message) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        BatchSizeSchedule(schedule, **arguments)


def test_simigrad_refuses_a_schedule_and_names_the_callback_that_takes_it() -> None:
    with pytest.raises(TypeError, match="use `BatchSizeSchedule"):
        SimiGrad(0.8, schedule={0: 8})


def test_a_schedule_holds_no_target_and_simigrad_refuses_to_run_without_one() -> None:
    schedule = BatchSizeSchedule(linear_ramp(start=8, end=32, over=100))
    assert schedule.settings.target_similarity is None  # nothing is compared with a target: none is made up
    for missing in ({"target_similarity": None}, {"target_similarity": None, "adjust": False}):
        with pytest.raises(ValueError, match="`target_similarity` is None.*BatchSizeSchedule"):
            SimiGrad(**missing)
