"""Lightning's own progress bars while SimiGrad changes the batch: a total from the first micro-batch,
a final count equal to it, a finite time remaining, a postfix that keeps its width; and the summary line."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger

from lightning_simigrad import SimiGrad
from tests.support.helpers import trainer
from tests.support.user_modules import ImagesDataModule, LitClassifier


class BarProbe(pl.Callback):
    """After the progress bar: what it shows after every training micro-batch (rank 0 only)."""

    def __init__(self, out: Path | None = None) -> None:
        self.out = out
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not trainer.is_global_zero:  # the bar is shown on rank 0 alone
            return
        bar = trainer.progress_bar_callback
        row = dict(epoch=trainer.current_epoch, batch_idx=batch_idx, estimate=trainer.num_training_batches)
        if isinstance(bar, TQDMProgressBar):
            tqdm = bar.train_progress_bar
            rendered = str(tqdm)
            eta = re.search(r"<(\d+:\d+)", rendered)
            row |= dict(n=tqdm.n, total=tqdm.total, eta=eta.group(1) if eta else None, postfix=tqdm.postfix)
        else:
            task = bar.train_progress_bar
            postfix = "".join(f"{k}:{v}" for k, v in bar.get_metrics(trainer, pl_module).items())
            row |= dict(n=task.completed, total=task.total, eta=task.time_remaining, postfix=postfix)
        row["last"] = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        self.rows.append(row)

    def on_train_end(self, trainer, pl_module):
        if self.out is not None and trainer.is_global_zero:
            simigrad = next(c for c in trainer.callbacks if isinstance(c, SimiGrad))
            payload = dict(rows=self.rows, sizes=[h["batch_size"] for h in simigrad.history])
            (self.out / "bar.json").write_text(json.dumps(payload))


def check_bar(rows: list[dict], sizes: list[float]) -> None:
    assert len(set(sizes)) > 3  # the batch size moved
    epochs = sorted({r["epoch"] for r in rows})
    for epoch in epochs:
        seen = [r for r in rows if r["epoch"] == epoch]
        assert all(r["total"] is not None and math.isfinite(r["total"]) for r in seen)  # from the first micro-batch
        assert all(r["n"] == r["batch_idx"] + 1 <= r["total"] == r["estimate"] for r in seen)
        assert seen[-1]["last"] and seen[-1]["n"] == seen[-1]["total"]  # the final count equals the total
        assert all(r["eta"] is not None for r in seen[3:])  # a time remaining once the bar has a rate
    postfixes = {len(r["postfix"]) for r in rows if "batch" in r["postfix"]}
    assert len(postfixes) == 1, postfixes  # SimiGrad's postfix keeps its width


@pytest.mark.parametrize("bar_class", [TQDMProgressBar, RichProgressBar])
def test_the_training_bar_shows_a_total_and_a_time_remaining_on_one_process(bar_class):
    pl.seed_everything(0)
    probe = BarProbe()
    cb = SimiGrad(target_similarity=0.9, max_batch_size=256)
    t = trainer(callbacks=[cb, bar_class(), probe], enable_progress_bar=True, max_epochs=2, limit_val_batches=0)
    t.fit(LitClassifier(), datamodule=ImagesDataModule(n=1024, batch_size=16))
    check_bar(probe.rows, [h["batch_size"] for h in cb.history])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("bar_class", [TQDMProgressBar, RichProgressBar])
def test_the_training_bar_shows_a_total_and_a_time_remaining_on_two_processes(tmp_path, bar_class):
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.9, max_batch_size=256)
    t = trainer(
        callbacks=[cb, bar_class(), BarProbe(tmp_path)],
        enable_progress_bar=True,
        devices=2,
        strategy="ddp_spawn",
        max_epochs=2,
        limit_val_batches=0,
    )
    t.fit(LitClassifier(), datamodule=ImagesDataModule(n=1024, batch_size=8))
    payload = json.loads((tmp_path / "bar.json").read_text())
    check_bar(payload["rows"], payload["sizes"])


def test_the_fit_ends_with_a_summary_in_the_log_and_the_logger(tmp_path, caplog):
    pl.seed_everything(0)
    datamodule = ImagesDataModule(n=1024, batch_size=16)
    cb = SimiGrad(target_similarity=0.9, max_batch_size=256)
    t = trainer(callbacks=[cb], logger=CSVLogger(tmp_path), max_epochs=2, limit_val_batches=0)
    with caplog.at_level("INFO"):
        t.fit(LitClassifier(), datamodule=datamodule)
    fixed_steps = 2 * math.ceil(896 / 16)  # 896 training images
    sizes = [int(h["batch_size"]) for h in cb.history]
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("SimiGrad:"))
    assert f"{t.global_step} optimizer steps over {2 * 896} samples" in line
    assert f"batch size {min(sizes)}..{max(sizes)} (B0 = 16)" in line
    assert f"a fixed batch of 16 takes {fixed_steps} steps" in line
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("simigrad/summary/optimizer_steps")]
    assert len(rows) == 1
    assert float(rows[0]["simigrad/summary/steps_at_initial_batch_size"]) == fixed_steps
    assert float(rows[0]["simigrad/summary/optimizer_steps"]) == t.global_step < fixed_steps
