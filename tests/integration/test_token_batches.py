"""Batches counted in tokens (`lengths`, `max_micro_batch_tokens`), on one process.

The module is written as language-model code is (tests/support/token_modules.py): micro-batches padded to their
longest sequence. Every step's logged batch size is its samples' tokens, within one sequence of what was asked; no
padded micro-batch exceeds `max_micro_batch_tokens`; every sample is trained once per epoch; with `loss_items` every
step's gradient is the float64 gradient of the mean over its labelled tokens; a mid-window resume continues step for
step; what cannot be served is refused with the fix.
"""

from __future__ import annotations

from collections import Counter

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_simigrad import BatchSizeSchedule, SimiGrad, linear_ramp
from lightning_simigrad.testing import StepAudit
from tests.support.helpers import trainer
from tests.support.token_modules import Sequences, TokenMeanLoss, TokenModel, indices_of, labelled_tokens, pad_collate

MAX_TOKENS = 40  # padded tokens of a micro-batch: at most 2 of the longest sequences (16 tokens)


class MicroBatches(pl.Callback):
    """Every micro-batch the module trains: its samples and its padded tokens."""

    def __init__(self) -> None:
        self.seen: list[tuple[list[int], int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append((indices_of(batch), batch["input_ids"].numel()))


def lengths_of(dataset: Sequences) -> list[int]:
    return [len(tokens) for tokens in dataset.tokens]


def fit(callback: pl.Callback, epochs: int = 2, dataset: Sequences | None = None, **loader):
    pl.seed_everything(0)
    dataset = dataset or Sequences()
    audit = StepAudit(indices=indices_of, mean_loss=TokenMeanLoss(dataset))
    micro = MicroBatches()
    t = trainer(callbacks=[callback, audit, micro], max_epochs=epochs)
    t.fit(TokenModel(), DataLoader(dataset, batch_size=4, shuffle=True, collate_fn=pad_collate, **loader))
    return audit, micro, dataset


def tokens_simigrad(**kwargs) -> SimiGrad:
    dataset = Sequences()
    args = {
        "lengths": lengths_of(dataset),
        "max_micro_batch_tokens": MAX_TOKENS,
        "initial_batch_size": 80,
        "max_batch_size": 400,
        "loss_items": labelled_tokens,
        **kwargs,
    }
    return SimiGrad(0.5, **args)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_count_tokens_within_the_bound_and_every_step_is_its_token_mean(workers) -> None:
    cb = tokens_simigrad()
    audit, micro, dataset = fit(cb, num_workers=workers, **({"persistent_workers": True} if workers else {}))
    lengths = lengths_of(dataset)
    sizes = [row["batch_size"] for row in cb.history]
    assert len(set(sizes)) >= 4  # the batch moved
    # the logged batch is the step's tokens, its samples beside it
    assert sizes == [sum(lengths[i] for i in step.samples) for step in audit.steps]
    assert [row["batch_samples"] for row in cb.history] == [len(step.samples) for step in audit.steps]
    assert max(padded for _, padded in micro.seen) <= MAX_TOKENS  # the memory bound, after padding
    # each sample once per epoch (the epoch's steps cover the dataset exactly)
    fed = Counter(i for indices, _ in micro.seen for i in indices)
    assert set(fed.values()) == {2} and len(fed) == len(dataset)
    assert max(step.grad_rel_error for step in audit.steps) < 1e-12  # every step: the mean over its tokens
    assert all(
        step.similarity == pytest.approx(row["similarity"], abs=1e-12)
        for step, row in zip(audit.steps, cb.history, strict=True)
    )


@pytest.mark.timeout(300)
def test_each_window_holds_the_tokens_asked_for_within_one_sequence() -> None:
    # a fixed schedule states what every window asks for: a window holds the consecutive samples whose tokens come
    # nearest it, so it is off by less than one sequence (the epoch's tail aside)
    ramp = linear_ramp(start=60, end=300, over=2_000)
    cb = BatchSizeSchedule(
        ramp, lengths=lengths_of(Sequences()), max_micro_batch_tokens=MAX_TOKENS, loss_items=labelled_tokens
    )
    audit, micro, dataset = fit(cb, epochs=3)
    trained, samples, longest, off = 0, 0, max(lengths_of(dataset)), []
    ends = {
        i for i, row in enumerate(cb.history) if (samples := samples + int(row["batch_samples"])) % len(dataset) == 0
    }
    assert len(ends) == 3  # every epoch ends at a step's end: each sample once
    tails = ends | {i - 1 for i in ends}  # an epoch's last two windows share what is left
    for i, row in enumerate(cb.history):
        if i not in tails:
            off.append(abs(row["batch_size"] - min(max(ramp(trained), 60), 300)))
        trained += int(row["batch_size"])
    assert max(off) <= longest / 2 + 1  # the nearest window's tokens: within half the longest sequence
    assert max(step.grad_rel_error for step in audit.steps) < 1e-12


def padding_fraction(micro: MicroBatches, lengths: list[int]) -> float:
    real = sum(lengths[i] for indices, _ in micro.seen for i in indices)
    return 1 - real / sum(padded for _, padded in micro.seen)


@pytest.mark.timeout(300)
def test_grouping_by_length_cuts_padding() -> None:
    dataset = Sequences(n=240, seed=3)
    lengths = lengths_of(dataset)
    cb = SimiGrad(0.5, adjust=False, lengths=lengths, max_micro_batch_tokens=64, initial_batch_size=160)
    _, grouped, _ = fit(cb, epochs=1, dataset=dataset)
    # the same tokens per step from a plain shuffled DataLoader: ~ 160 / mean length samples, in micro-batches of 4
    plain = MicroBatches()
    loader = DataLoader(dataset, batch_size=4, shuffle=True, collate_fn=pad_collate)
    for batch in loader:
        plain.seen.append((indices_of(batch), batch["input_ids"].numel()))
    ours, theirs = padding_fraction(grouped, lengths), padding_fraction(plain, lengths)
    # grouped within each half (the halves are balanced first, see core/token_plan.py): 0.23 against 0.30 here
    assert ours < 0.85 * theirs, (ours, theirs)


class SaveInsideWindow(pl.Callback):
    """Saves after the first micro-batch of the window that follows optimizer step ``step``."""

    def __init__(self, path, step: int) -> None:
        self.path, self.step, self.seen = path, step, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.seen += 1
            if self.seen == 2:
                trainer.save_checkpoint(self.path)


@pytest.mark.timeout(300)
def test_a_mid_window_resume_continues_step_for_step(tmp_path) -> None:
    def fit_once(callbacks, ckpt_path=None):
        pl.seed_everything(0)
        cb = tokens_simigrad()
        model = TokenModel()
        t = trainer(callbacks=[cb, *callbacks], max_epochs=2)
        t.fit(model, DataLoader(Sequences(), batch_size=4, shuffle=True, collate_fn=pad_collate), ckpt_path=ckpt_path)
        return cb, model

    whole, whole_model = fit_once([SaveInsideWindow(tmp_path / "mid.ckpt", step=4)])
    resumed, resumed_model = fit_once([], ckpt_path=tmp_path / "mid.ckpt")
    rows = [(r["step"], r["batch_size"], r["batch_samples"], r["similarity"]) for r in whole.history]
    assert [(r["step"], r["batch_size"], r["batch_samples"], r["similarity"]) for r in resumed.history] == rows[4:]
    for p, q in zip(whole_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.timeout(300)
def test_the_fit_length_and_budget_count_tokens() -> None:
    # max_samples counts what batch sizes count: tokens; the last step ends within one sequence past it
    cb = tokens_simigrad(max_samples=1_500, adjust=False)
    seen: list[float] = []

    class Estimate(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            seen.append(trainer.estimated_stepping_batches)

    pl.seed_everything(0)
    t = trainer(callbacks=[cb, Estimate()], max_epochs=5)
    t.fit(TokenModel(), DataLoader(Sequences(), batch_size=4, shuffle=True, collate_fn=pad_collate))
    tokens = sum(row["batch_size"] for row in cb.history)
    assert 1_500 <= tokens < 1_500 + 16
    assert cb.summary()["tokens"] == tokens
    assert seen == [-(-1_500 // 80)]  # steps of B0 = 80 tokens


def test_refusals_name_the_setting_and_the_fix() -> None:
    with pytest.raises(ValueError, match="give `lengths` too"):
        SimiGrad(0.5, max_micro_batch_tokens=512)
    with pytest.raises(ValueError, match="give `initial_batch_size` \\(B0\\) in tokens"):
        SimiGrad(0.5, lengths=[3, 4])
    with pytest.raises(ValueError, match="`lengths` must be one int per sample"):
        SimiGrad(0.5, lengths="abc", initial_batch_size=64)
    with pytest.raises(ValueError, match="`max_micro_batch_tokens` must be a positive int"):
        SimiGrad(0.5, lengths=[3], initial_batch_size=64, max_micro_batch_tokens=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        (lambda n: list(range(1, n)), "holds 119 lengths but the training dataset has 120 samples"),
        (lambda n: [0] + [4] * (n - 1), "gives sample 0 0 tokens"),
        (lambda n: [4] * (n - 1) + [50], "Sample 119 has 50 tokens, more than `max_micro_batch_tokens=40`"),
        (lambda n: lambda sample: "12 tokens", "`lengths(sample)` returned '12 tokens' for sample 0"),
        (lambda n: lambda sample: 3.5, "`lengths(sample)` returned 3.5 for sample 0"),
    ],
)
def test_bad_lengths_are_refused_before_the_first_step(lengths, message) -> None:
    cb = SimiGrad(0.5, lengths=lengths(120), max_micro_batch_tokens=MAX_TOKENS, initial_batch_size=80)
    model = TokenModel()
    before = [p.detach().clone() for p in model.parameters()]
    t = trainer(callbacks=[cb], max_epochs=1)
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        t.fit(model, DataLoader(Sequences(), batch_size=4, shuffle=True, collate_fn=pad_collate))
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters(), strict=True))


@pytest.mark.timeout(120)
def test_a_function_of_a_sample_gives_the_lengths() -> None:
    cb = tokens_simigrad(lengths=lambda sample: len(sample["input_ids"]))
    audit, micro, dataset = fit(cb, epochs=1)
    lengths = lengths_of(dataset)
    assert [row["batch_size"] for row in cb.history] == [sum(lengths[i] for i in s.samples) for s in audit.steps]
    assert max(padded for _, padded in micro.seen) <= MAX_TOKENS


@pytest.mark.timeout(300)
def test_at_a_low_target_a_token_batch_shrinks_no_further_than_a_measurable_one() -> None:
    """The default smallest batch is the two sequences the halves need, in tokens at the data's mean length: never
    one sequence (unmeasurable), and every step measured."""
    dataset = Sequences()
    lengths = lengths_of(dataset)
    cb = SimiGrad(-0.9, lengths=lengths, initial_batch_size=80, max_micro_batch_tokens=MAX_TOKENS)
    audit, _, _ = fit(cb, dataset=dataset)
    samples = [len(step.samples) for step in audit.steps]
    assert min(samples) == 2 and samples.count(2) >= len(samples) // 3  # shrunk to the floor and held there
    mean = sum(lengths) / len(lengths)
    assert cb.run.controller.min_batch_size == -(-2 * sum(lengths) // len(lengths)) >= 2 * mean
    assert all(row["similarity"] == row["similarity"] for row in cb.history)  # none NaN: every step measured


def test_a_min_batch_size_below_a_measurable_batch_is_raised_and_said_once() -> None:
    dataset = Sequences()
    cb = SimiGrad(-0.9, lengths=lengths_of(dataset), initial_batch_size=80, min_batch_size=3)
    with pytest.warns(UserWarning, match=r"`min_batch_size=3` is below the 2 sequences a measurement needs") as caught:
        fit(cb, epochs=1, dataset=dataset)
    assert sum("min_batch_size=3" in str(w.message) for w in caught) == 1


class FirstTotal(pl.Callback):
    """The epoch's total of micro-batches as the bars first read it (at the epoch's start, after SimiGrad's hook), and
    the count the epoch ends with."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.count: Counter = Counter()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.first[trainer.current_epoch] = trainer.num_training_batches

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.count[trainer.current_epoch] += 1


def test_the_first_estimate_of_an_epochs_micro_batches_counts_token_windows() -> None:
    """The bars' first total of a token epoch: windows of B0 tokens (about 8 samples here), not of B0 samples."""
    totals = FirstTotal()
    dataset = Sequences()
    cb = tokens_simigrad(adjust=False, loss_items=None)
    pl.seed_everything(0)
    t = trainer(callbacks=[cb, totals], max_epochs=1)
    t.fit(TokenModel(), DataLoader(dataset, batch_size=4, shuffle=True, collate_fn=pad_collate))
    assert abs(totals.first[0] - totals.count[0]) <= 0.25 * totals.count[0], (totals.first, totals.count)
