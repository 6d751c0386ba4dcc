"""Streams on one process: a torch ``IterableDataset`` through a plain ``DataLoader`` and through torchdata's
``StatefulDataLoader``, re-batched into SimiGrad's windows.

Every sample is trained once per pass, every step's gradient is the mean over exactly its samples, the batch moves,
a mid-epoch resume of a stateful loader continues step for step, and a stateless one's is refused with the fix.
The step estimate comes from what bounds the fit (refused where nothing does), the progress bar counts without a
total, and a stream of sequences weighs every labelled token of a step alike (``loss_items``).
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_simigrad import SimiGrad
from lightning_simigrad.testing import StepAudit
from tests.support.helpers import IndexedRegression, Regressor, step_audit, trainer
from tests.support.streams import IndexedStream, SaveAtStep, each_sample_once
from tests.support.token_modules import Sequences, TokenMeanLoss, TokenModel, indices_of, labelled_tokens, pad_collate

N = 150
EPOCHS = 2


def fit(loader_type=DataLoader, workers: int = 0, callbacks=(), ckpt_path=None, **simigrad):
    pl.seed_everything(0)
    dataset = IndexedRegression(N)
    cb = SimiGrad(**({"initial_batch_size": 16, "target_similarity": 0.3} | simigrad))
    audit = step_audit(dataset)
    model = Regressor()
    t = trainer(callbacks=[cb, audit, *callbacks], max_epochs=EPOCHS)
    loader = loader_type(IndexedStream(dataset, shuffle=True), batch_size=4, num_workers=workers)
    t.fit(model, loader, ckpt_path=ckpt_path)
    return cb, audit, model


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loader_type", [DataLoader, StatefulDataLoader], ids=["DataLoader", "StatefulDataLoader"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_trains_every_sample_once_per_pass_with_exact_gradients(loader_type, workers: int) -> None:
    cb, audit, _ = fit(loader_type, workers)
    samples = [step.samples for step in audit.steps]
    each_sample_once(samples, N, EPOCHS)
    sizes = [len(s) for s in samples]
    assert [row["batch_size"] for row in cb.history] == sizes  # what it logs is what it trained
    assert len(set(sizes[:-1])) >= 2  # the controller moved the batch (not only an epoch's tail)
    assert all(size % 4 == 0 for size in sizes[:9])  # whole loader batches until the epoch's tail
    assert max(step.grad_rel_error for step in audit.steps) < 1e-12


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_mid_epoch_resume_of_a_stateful_loader_continues_step_for_step(tmp_path, workers: int) -> None:
    whole, whole_audit, whole_model = fit(StatefulDataLoader, workers, [SaveAtStep(tmp_path / "mid.ckpt", step=4)])
    state = torch.load(tmp_path / "mid.ckpt", weights_only=True)["callbacks"]["SimiGrad"]
    assert 0 < state["counts"]["epoch_samples_done"] < N and state["schedule"]["planned"]  # drawn ahead of training
    assert len(state["stream"]) == 1 and state["stream"][0]  # the one process's loader position
    resumed, resumed_audit, resumed_model = fit(StatefulDataLoader, workers, ckpt_path=tmp_path / "mid.ckpt")
    rows = [(r["step"], r["batch_size"], r["samples_seen"]) for r in whole.history]
    assert [(r["step"], r["batch_size"], r["samples_seen"]) for r in resumed.history] == rows[4:]
    assert [s.samples for s in resumed_audit.steps] == [s.samples for s in whole_audit.steps[4:]]
    for p, q in zip(whole_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.timeout(300)
def test_a_mid_epoch_resume_of_a_stateless_stream_is_refused_with_the_fix(tmp_path) -> None:
    fit(DataLoader, 0, [SaveAtStep(tmp_path / "mid.ckpt", step=4)])
    message = r"has no `state_dict`: the rest of the epoch cannot be found.*StatefulDataLoader"
    with pytest.raises(RuntimeError, match=message):
        fit(DataLoader, 0, ckpt_path=tmp_path / "mid.ckpt")


@pytest.mark.timeout(300)
def test_max_samples_ends_a_stream_exactly() -> None:
    cb, audit, _ = fit(DataLoader, 0, max_samples=101)
    assert sum(len(step.samples) for step in audit.steps) == 101
    assert max(step.grad_rel_error for step in audit.steps) < 1e-12


def test_a_micro_batch_cap_below_the_loaders_batch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"above `max_micro_batch_size=2`.*batch_size=2"):
        fit(DataLoader, 0, max_micro_batch_size=2)


class AsksForItsLength(Regressor):
    """A module whose schedule's length is ``trainer.estimated_stepping_batches``, as one-cycle schedules are."""

    def configure_optimizers(self):
        self.asked = self.trainer.estimated_stepping_batches
        return super().configure_optimizers()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("bounds", "expected"), [({"max_samples": 101}, 7), ({"max_steps": 5}, 5)])
def test_the_step_estimate_of_a_stream_comes_from_what_bounds_the_fit(bounds, expected: int) -> None:
    pl.seed_everything(0)
    simigrad = {key: value for key, value in bounds.items() if key == "max_samples"}
    limits = {key: value for key, value in bounds.items() if key != "max_samples"}
    model = AsksForItsLength()
    t = trainer(callbacks=[SimiGrad(0.3, initial_batch_size=16, **simigrad)], max_epochs=EPOCHS, **limits)
    t.fit(model, DataLoader(IndexedStream(IndexedRegression(N)), batch_size=4))
    assert model.asked == expected  # steps of B0 = 16 samples: ceil(101 / 16), or max_steps


@pytest.mark.timeout(300)
def test_the_step_estimate_of_an_unbounded_stream_is_refused_with_the_fix() -> None:
    # Lightning alone answers max_steps (-1) here, which a scheduler would take for the fit's length
    t = trainer(callbacks=[SimiGrad(0.3, initial_batch_size=16)], max_epochs=EPOCHS)
    message = r"the training data is a stream.*max_epochs=2.*`Trainer\(max_steps=...\)`.*`SimiGrad\(max_samples=...\)`"
    with pytest.raises(RuntimeError, match=message):
        t.fit(AsksForItsLength(), DataLoader(IndexedStream(IndexedRegression(N)), batch_size=4))


@pytest.mark.timeout(300)
def test_the_progress_bar_counts_a_stream_without_a_made_up_total() -> None:
    totals = []

    class Totals(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            bar = trainer.progress_bar_callback
            totals.append((bar.train_progress_bar.total, bar.train_progress_bar.n))

    bar = TQDMProgressBar()
    t = trainer(callbacks=[SimiGrad(0.3, initial_batch_size=16), bar, Totals()], enable_progress_bar=True)
    t.fit(Regressor(), DataLoader(IndexedStream(IndexedRegression(N)), batch_size=4))
    assert {total for total, _ in totals} == {None}
    assert [n for _, n in totals] == list(range(1, len(totals) + 1))  # every micro-batch counted
    assert len(totals) >= N // 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_of_sequences_weighs_every_labelled_token_of_a_step_alike(workers: int) -> None:
    # where streams and loss items meet: a stream's windows are planned in samples, its steps weighed in tokens
    pl.seed_everything(0)
    dataset = Sequences()
    cb = SimiGrad(0.5, loss_items=labelled_tokens, initial_batch_size=8, max_batch_size=40)
    audit = StepAudit(indices=indices_of, mean_loss=TokenMeanLoss(dataset))
    t = trainer(callbacks=[cb, audit], max_epochs=EPOCHS)
    stream = IndexedStream(dataset, shuffle=True)
    t.fit(TokenModel(), DataLoader(stream, batch_size=4, num_workers=workers, collate_fn=pad_collate))
    each_sample_once([step.samples for step in audit.steps], len(dataset), EPOCHS)
    assert len({row["batch_size"] for row in cb.history}) >= 2  # the batch moved
    assert max(step.grad_rel_error for step in audit.steps) < 1e-12


@pytest.mark.timeout(300)
def test_what_a_streams_whole_loader_batches_make_of_b0_is_said_once_at_the_start() -> None:
    """One process, loader batches of 4: B0 = 4 cannot be two halves of whole loader batches; it runs as 8."""
    with pytest.warns(UserWarning, match=r"steps of 4: B0 = 4 is trained as windows of 8") as caught:
        cb, audit, _ = fit(DataLoader, 0, initial_batch_size=4, adjust=False)
    assert sum("whole loader batches" in str(w.message) for w in caught) == 1
    sizes = [len(step.samples) for step in audit.steps]  # what it said is what it trained, but for each pass's tail
    assert sizes == ([8] * (N // 8) + [N % 8]) * EPOCHS
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # B0 = 16 is four whole batches: nothing to say
        warnings.filterwarnings("ignore", message=r"(?!A stream's windows)")
        fit(DataLoader, 0, initial_batch_size=16, adjust=False)


def test_lengths_over_a_stream_is_refused_before_the_first_step_with_the_fix() -> None:
    with pytest.raises(RuntimeError, match=r"this training DataLoader is a stream.*leave out `lengths`"):
        fit(DataLoader, 0, lengths=[4] * N)
