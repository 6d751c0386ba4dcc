"""`loss_items`: every labelled token of a step weighs exactly 1 / (the step's labelled tokens), on one process.

The module is written as language-model code is (tests/support/token_modules.py): micro-batches padded to their
longest sequence, labels -100 on padding and prompts, `training_step` returning the mean over its labelled tokens.
Every step's gradient is compared with the float64 gradient of (sum of the step's token losses) / (its tokens),
and each half's measured similarity with that of the halves' token means, while the batch moves. Without
`loss_items` the same module trains on a mean of per-micro-batch means, far off.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_simigrad import BatchSizeSchedule, SimiGrad, linear_ramp
from lightning_simigrad.testing import StepAudit
from lightning_simigrad.weighing import count_items
from tests.support.helpers import trainer
from tests.support.token_modules import Sequences, TokenMeanLoss, TokenModel, indices_of, labelled_tokens, pad_collate


def fit(callback: pl.Callback, epochs: int = 2) -> StepAudit:
    pl.seed_everything(0)
    dataset = Sequences()
    audit = StepAudit(indices=indices_of, mean_loss=TokenMeanLoss(dataset))
    t = trainer(callbacks=[callback, audit], max_epochs=epochs)
    t.fit(TokenModel(), DataLoader(dataset, batch_size=4, shuffle=True, collate_fn=pad_collate))
    return audit


@pytest.mark.timeout(300)
def test_every_step_is_the_mean_over_its_tokens_and_the_halves_are_token_means() -> None:
    cb = SimiGrad(0.5, loss_items=labelled_tokens, max_micro_batch_size=4, initial_batch_size=8, max_batch_size=40)
    audit = fit(cb)
    assert len({row["batch_size"] for row in cb.history}) >= 3  # the batch moved
    assert [row["batch_size"] for row in cb.history] == [len(step.samples) for step in audit.steps]  # in samples
    assert max(step.grad_rel_error for step in audit.steps) < 1e-12
    measured = [(row["similarity"], step.similarity) for row, step in zip(cb.history, audit.steps, strict=True)]
    assert all(math.isfinite(ours) for ours, _ in measured)
    assert max(abs(ours - reference) for ours, reference in measured) < 1e-12  # cos of the halves' token means


@pytest.mark.timeout(300)
def test_without_loss_items_the_same_module_is_off() -> None:
    # the property the test above checks can fail: weighing samples makes a step a mean of micro-batch means
    audit = fit(SimiGrad(0.5, max_micro_batch_size=4, initial_batch_size=8, max_batch_size=40))
    assert max(step.grad_rel_error for step in audit.steps) > 0.1


@pytest.mark.timeout(300)
def test_a_fixed_schedule_weighs_tokens_too() -> None:
    cb = BatchSizeSchedule(linear_ramp(start=8, end=24, over=120), loss_items=labelled_tokens, max_micro_batch_size=4)
    audit = fit(cb)
    assert len({len(step.samples) for step in audit.steps}) >= 3
    assert max(step.grad_rel_error for step in audit.steps) < 1e-12


class SaveInsideWindow(pl.Callback):
    """Saves after the first micro-batch of the window that follows optimizer step ``step``."""

    def __init__(self, path, step: int) -> None:
        self.path, self.step, self.seen = path, step, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.seen += 1
            if self.seen == 2:  # the first end is the step's own last micro-batch
                trainer.save_checkpoint(self.path)


@pytest.mark.timeout(300)
def test_a_mid_window_resume_continues_step_for_step(tmp_path) -> None:
    def fit_once(callbacks, ckpt_path=None):
        pl.seed_everything(0)
        cb = SimiGrad(0.5, loss_items=labelled_tokens, max_micro_batch_size=4, initial_batch_size=8)
        model = TokenModel()
        t = trainer(callbacks=[cb, *callbacks], max_epochs=2)
        t.fit(model, DataLoader(Sequences(), batch_size=4, shuffle=True, collate_fn=pad_collate), ckpt_path=ckpt_path)
        return cb, model

    # written after a micro-batch inside a window: the resumed fit redoes the window from its start
    whole, whole_model = fit_once([SaveInsideWindow(tmp_path / "mid.ckpt", step=3)])
    state = torch.load(tmp_path / "mid.ckpt", weights_only=False)["callbacks"]["SimiGrad"]
    assert state["counts"]["steps"] == 3  # written inside step 4's window: the resumed fit redoes that window
    resumed, resumed_model = fit_once([], ckpt_path=tmp_path / "mid.ckpt")
    rows = [(r["step"], r["batch_size"], r["similarity"]) for r in whole.history]
    assert [(r["step"], r["batch_size"], r["similarity"]) for r in resumed.history] == rows[3:]
    for p, q in zip(whole_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("returned", "shown"), [(-3, "-3"), (2.5, "2.5"), ("7", "'7'"), (None, "None"), (True, "True")]
)
def test_a_bad_count_names_the_argument_and_shows_the_value(returned, shown) -> None:
    with pytest.raises(ValueError, match="`loss_items` must return") as info:
        count_items(lambda batch: returned, None)
    assert f"returned {shown}." in str(info.value)


def test_loss_items_must_be_a_function() -> None:
    with pytest.raises(ValueError, match="`loss_items` must be a function of a micro-batch") as info:
        SimiGrad(0.5, loss_items=3)
    assert "got 3." in str(info.value)
