"""Learn once, replay: a finished SimiGrad run's batch sizes, replayed by BatchSizeSchedule.

A run is recorded with SimiGrad (the batch moving, over several epochs, so that epochs' last two windows share what is
left, some below `min_batch_size`) and replayed from its history, on the same data and seed: the replay trains the
recorded batch sizes step for step, in samples and in tokens, and ends on the same weights. The same schedule is
read from the recipes' CSV and from a W&B export; a replay checkpointed before a short tail resumes step for step;
smoothed and snapped to doublings, it still trains; every mistake is refused with the fix.
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_simigrad import BatchSizeSchedule, SimiGrad
from lightning_simigrad.core.replay import read_trace
from tests.support.helpers import IndexedRegression, Regressor, trainer
from tests.support.token_modules import Sequences, TokenModel, labelled_tokens, pad_collate

N = 150  # samples an epoch
EPOCHS = 4


def fit_samples(callback: pl.Callback, epochs: int = EPOCHS) -> tuple[pl.Callback, Regressor]:
    pl.seed_everything(0)
    model = Regressor()
    trainer(callbacks=[callback], max_epochs=epochs).fit(
        model, DataLoader(IndexedRegression(N), batch_size=8, shuffle=True)
    )
    return callback, model


def fit_tokens(callback: pl.Callback, dataset: Sequences | None = None, epochs: int = 3, shuffle: bool = True):
    pl.seed_everything(0)
    model = TokenModel()
    loader = DataLoader(dataset or Sequences(), batch_size=4, shuffle=shuffle, collate_fn=pad_collate)
    trainer(callbacks=[callback], max_epochs=epochs).fit(model, loader)
    return callback, model


def column(history: list[dict], key: str) -> list[int]:
    return [int(row[key]) for row in history]


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.fixture(scope="module")
def recorded() -> tuple[SimiGrad, Regressor]:
    """SimiGrad in samples, its batch bounded below by B0 = 16: epochs' tails fall below the bound."""
    return fit_samples(
        SimiGrad(0.5, initial_batch_size=16, min_batch_size=16, max_batch_size=64, max_micro_batch_size=8)
    )


@pytest.mark.timeout(300)
def test_a_replay_from_history_trains_the_recorded_batches_step_for_step(recorded) -> None:
    simigrad, model = recorded
    sizes = column(simigrad.history, "batch_size")
    assert len(set(sizes)) >= 6 and sum(sizes) == EPOCHS * N  # the batch moved over every epoch
    assert min(sizes) < 16  # an epoch's last two windows shared what was left, below min_batch_size
    replay, replayed = fit_samples(BatchSizeSchedule.from_history(simigrad.history, max_micro_batch_size=8))
    assert column(replay.history, "batch_size") == sizes
    assert column(replay.history, "samples_seen") == column(simigrad.history, "samples_seen")
    # the same windows with the same B0 (the first step's size): the same learning rates, gradients and weights
    assert [row["lr_scale"] for row in replay.history] == [row["lr_scale"] for row in simigrad.history]
    assert same_weights(model, replayed)


def lengths_of(dataset: Sequences) -> list[int]:
    return [len(tokens) for tokens in dataset.tokens]


@pytest.mark.timeout(300)
def test_a_replay_in_tokens_trains_the_recorded_windows_step_for_step() -> None:
    tokens = {
        "lengths": lengths_of(Sequences()),
        "max_micro_batch_tokens": 40,
        "initial_batch_size": 80,
        "loss_items": labelled_tokens,
    }
    simigrad, model = fit_tokens(SimiGrad(0.5, min_batch_size=80, max_batch_size=400, **tokens))
    sizes = column(simigrad.history, "batch_size")
    assert len(set(sizes)) >= 6 and "tokens_seen" in simigrad.history[0]
    replay, replayed = fit_tokens(BatchSizeSchedule.from_history(simigrad.history, **tokens))
    for key in ("batch_size", "batch_samples", "tokens_seen", "samples_seen"):
        assert column(replay.history, key) == column(simigrad.history, key), key
    assert same_weights(model, replayed)


class ShortTail(Sequences):
    """Twenty sequences of 10 tokens, then 3, 3, 3, 3, 3, 40, 3, 3: at 40 tokens a window, the epoch's last window
    would be the last 2 samples, so the last two share the 8 left, 4 each; the first share's 12 tokens lie below the
    smallest batch a measurement needs in tokens (2 sequences at the mean length, 19 tokens)."""

    LENGTHS = [10] * 20 + [3, 3, 3, 3, 3, 40, 3, 3]

    def __init__(self) -> None:
        super().__init__(n=len(self.LENGTHS))
        g = torch.Generator().manual_seed(1)
        self.tokens = [torch.randint(1, 24, (n,), generator=g) for n in self.LENGTHS]
        self.prompts = [0] * len(self.LENGTHS)


@pytest.mark.timeout(300)
def test_an_epoch_tail_below_the_smallest_batch_is_replayed_as_it_was() -> None:
    # brought up to 19 tokens, the first share would take 5 samples, and then all 8 (3 would be too few to be left)
    tokens = {"lengths": ShortTail.LENGTHS, "max_micro_batch_tokens": 80, "loss_items": labelled_tokens}
    recorded, _ = fit_tokens(BatchSizeSchedule({0: 40}, **tokens), ShortTail(), epochs=2, shuffle=False)
    windows = list(zip(column(recorded.history, "batch_size"), column(recorded.history, "batch_samples")))
    assert windows[5:7] == [(12, 4), (49, 4)]  # the tail's two shares
    replay, _ = fit_tokens(BatchSizeSchedule.from_history(recorded.history, **tokens), ShortTail(), 2, False)
    assert list(zip(column(replay.history, "batch_size"), column(replay.history, "batch_samples"))) == windows


class SaveAfterStep(pl.Callback):
    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step, self.saved = path, step, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and not self.saved:
            self.saved = True
            trainer.save_checkpoint(self.path)


@pytest.mark.timeout(300)
def test_a_replay_resumed_before_the_short_tail_continues_step_for_step(tmp_path: Path) -> None:
    tokens = {"lengths": ShortTail.LENGTHS, "max_micro_batch_tokens": 80, "loss_items": labelled_tokens}
    recorded, _ = fit_tokens(BatchSizeSchedule({0: 40}, **tokens), ShortTail(), epochs=2, shuffle=False)

    def replay(callbacks=(), ckpt_path=None):
        pl.seed_everything(0)
        callback, model = BatchSizeSchedule.from_history(recorded.history, **tokens), TokenModel()
        loader = DataLoader(ShortTail(), batch_size=4, shuffle=False, collate_fn=pad_collate)
        trainer(callbacks=[callback, *callbacks], max_epochs=2).fit(model, loader, ckpt_path=ckpt_path)
        return callback, model

    whole, whole_model = replay([SaveAfterStep(tmp_path / "mid.ckpt", step=5)])
    state = torch.load(tmp_path / "mid.ckpt", weights_only=False)["callbacks"]["BatchSizeSchedule"]["schedule"]
    assert state["planned"] == [12]  # the tail's first share, below the smallest batch, planned before the save
    resumed, resumed_model = replay(ckpt_path=tmp_path / "mid.ckpt")
    assert column(resumed.history, "batch_size") == column(whole.history, "batch_size")[5:]
    assert same_weights(whole_model, resumed_model)


def write_trace(history: list[dict], path: Path, wandb: bool = False) -> Path:
    """The recipes' CSV (the history's keys), or a W&B export: `simigrad/` columns among others, a validation row
    whose `simigrad/*` cells are empty, an image column that is not a number."""
    keys = list(history[0])
    with path.open("w", newline="") as f:
        if not wandb:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(history)
            return path
        names = ["_step", "epoch", "val/loss", "simigrad/trace", *(f"simigrad/{k}" for k in keys)]
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for i, row in enumerate(history):
            cells = {f"simigrad/{k}": v for k, v in row.items()}
            writer.writerow({"_step": 2 * i, "epoch": 0, "simigrad/trace": "{'_type': 'image-file'}", **cells})
            writer.writerow({"_step": 2 * i + 1, "epoch": 0, "val/loss": 0.5})  # another metric's row
    return path


def test_the_recipes_csv_and_a_wandb_export_give_the_history_s_schedule(recorded, tmp_path: Path) -> None:
    history = recorded[0].history
    expected = BatchSizeSchedule.from_history(history).settings.schedule.steps
    assert len(expected) >= 10
    for name, wandb in (("simigrad_trace.csv", False), ("wandb_export.csv", True)):
        path = write_trace(history, tmp_path / name, wandb)
        assert BatchSizeSchedule.from_trace(path).settings.schedule.steps == expected, name
    assert BatchSizeSchedule.from_trace(tmp_path).settings.schedule.steps == expected  # the run directory
    rows, lines = read_trace(tmp_path / "wandb_export.csv")
    assert len(rows) == len(history) and lines[:2] == ["line 2", "line 4"]
    assert rows[0]["similarity"] == pytest.approx(history[0]["similarity"]) and "trace" not in rows[0]


@pytest.mark.timeout(300)
def test_a_snapped_schedule_doubles_from_b0_and_trains(recorded) -> None:
    history = recorded[0].history
    replay = BatchSizeSchedule.from_history(history, smooth=5, snap="doubling", max_micro_batch_size=8)
    steps = replay.settings.schedule.steps
    assert set(steps.values()) >= {16, 32}
    assert all(size % 16 == 0 and (size // 16).bit_count() == 1 for size in steps.values())  # 16 x 2^k, k >= 0
    assert replay.initial_batch_size == 16
    fit_samples(replay, epochs=2)
    sizes = column(replay.history, "batch_size")
    assert sum(sizes) == 2 * N and set(sizes) >= {16, 32}
    trained, ends = 0, set()  # every step but an epoch's last two is the schedule's size for what came before it
    for i, size in enumerate(sizes):
        trained += size
        if trained % N == 0:
            ends |= {i, i - 1}
    trained = 0
    for i, size in enumerate(sizes):
        assert i in ends or size == replay.settings.schedule(trained), (i, trained, size)
        trained += size


def tiny_history(unit: str = "samples") -> list[dict]:
    rows = [
        {"step": 1.0, "batch_size": 8.0, "samples_seen": 8.0},
        {"step": 2.0, "batch_size": 16.0, "samples_seen": 24.0},
    ]
    if unit == "tokens":
        for row, tokens in zip(rows, (80.0, 240.0)):
            row["tokens_seen"] = tokens
    return rows


@pytest.mark.parametrize(
    ("history", "arguments", "error", "message"),
    [
        ([], {}, ValueError, r"`history` holds no steps"),
        (tiny_history("tokens"), {}, ValueError, r"`lengths` = None, but `history` counts tokens .* Pass the recorded"),
        (tiny_history(), {"lengths": [3] * 9}, ValueError, r"`lengths` = a list of 9 lengths, but `history` counts"),
        (tiny_history(), {"min_batch_size": 8}, ValueError, r"`min_batch_size` = 8 with a replay .* Leave"),
        (tiny_history()[::-1], {}, ValueError, r"starts after 8 samples trained \(row 0, of 16 samples"),
        (tiny_history()[:1] * 2, {}, ValueError, r"row 1 ends at 8 samples .* starts before row 0 ends"),
        ([{"batch_size": 8.0}], {}, ValueError, r"no `samples_seen` column \(it has batch_size\)"),
        ([{"batch_size": 8.5, "samples_seen": 8.0}], {}, ValueError, r"`batch_size` = 8.5 is not a whole number"),
        ([{"batch_size": 0.0, "samples_seen": 0.0}], {}, ValueError, r"a batch size must be a positive int"),
        (tiny_history(), {"smooth": 4}, ValueError, r"`smooth` = 4: .* an odd positive int"),
        (tiny_history(), {"snap": "powers"}, ValueError, r"`snap` = 'powers': one of 'doubling'"),
    ],
    ids=[
        "empty", "tokens-without-lengths", "samples-with-lengths", "bounds", "not-from-the-start", "overlapping",
        "missing-column", "fractional", "zero", "even-window", "unknown-snap",
    ],
)  # fmt: skip
def test_a_bad_history_or_option_is_refused_with_the_fix(history, arguments, error, message) -> None:
    with pytest.raises(error, match=message):
        BatchSizeSchedule.from_history(history, **arguments)


def test_a_bad_trace_file_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"is not a file: pass the simigrad_trace.csv a recipe wrote"):
        BatchSizeSchedule.from_trace(tmp_path / "missing.csv")
    (tmp_path / "notes.csv").write_text("loss,acc\n0.5,0.9\n")
    with pytest.raises(ValueError, match=r"has no `batch_size`, `samples_seen` or `tokens_seen` column"):
        BatchSizeSchedule.from_trace(tmp_path / "notes.csv")
    (tmp_path / "bad.csv").write_text("batch_size,samples_seen\n8,8\nlots,24\n")
    with pytest.raises(ValueError, match=r"line 3: `batch_size` = 'lots' is not a number"):
        BatchSizeSchedule.from_trace(tmp_path / "bad.csv")
    (tmp_path / "schedule.yaml").write_text("unit: samples\nschedule: {0: 8, 8: 16}\n")
    with pytest.raises(ValueError, match=r"`smooth` = 5 with the schedule .* replayed as written"):
        BatchSizeSchedule.from_trace(tmp_path / "schedule.yaml", smooth=5)
    assert BatchSizeSchedule.from_trace(tmp_path / "schedule.yaml").settings.schedule.steps == {0: 8, 8: 16}
    (tmp_path / "tokens.yaml").write_text("unit: tokens\nschedule: {0: 80}\n")
    with pytest.raises(ValueError, match=r"`lengths` = None, but '.*tokens.yaml' counts tokens"):
        BatchSizeSchedule.from_trace(tmp_path / "tokens.yaml")
