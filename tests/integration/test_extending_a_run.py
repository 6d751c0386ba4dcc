"""Resuming from every checkpoint a user can write, over map-style data and the streams SimiGrad serves, continues the
uninterrupted run step for step: a checkpoint written in the middle of a fit, ``ModelCheckpoint(save_last=True)``
where ``max_steps`` stopped it, ``trainer.save_checkpoint`` after ``fit``, and one written at an epoch's end.

``max_steps`` stops a fit inside an epoch and Lightning counts that epoch as done; resumed with a larger ``max_steps``
it finishes the epoch's data as its next epoch, and SimiGrad with it. A stop that lands inside a window of the
uninterrupted run cuts that window to what is left: every sample is still trained once per epoch, on every rank.
Resumed with ``max_steps=-1``, Lightning starts the next epoch, and so does SimiGrad, saying what is left untrained.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_simigrad import SimiGrad
from tests.support.distributed import run_ok
from tests.support.fsdp_modules import as_external_process
from tests.support.helpers import IndexedRegression, Regressor, step_audit, trainer
from tests.support.stream_packages import LitDataModule, write_litdata_chunks
from tests.support.streams import IndexedStream, SaveAtStep

N = 96  # samples an epoch
B0 = 8
MAX_STEPS = 30  # the whole fit: 240 samples, two and a half epochs
LOADERS = ["map", "litdata", "stateful"]


@pytest.fixture(scope="module")
def chunks(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("litdata") / "chunks")
    write_litdata_chunks(path, N)
    return path


class SaveAtTheFirstBatch(pl.Callback):
    """Writes a checkpoint at the fit's first micro-batch, before any optimizer step of it."""

    def __init__(self, path: str) -> None:
        self.path, self.saved = path, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.saved:
            self.saved = True
            trainer.save_checkpoint(self.path)


@dataclass
class Fit:
    samples: list[list[int]]  # every step's samples
    rows: list[float]  # every step's batch size
    params: list[torch.Tensor]


def _fit(loader: str, chunks: str, max_steps: int, max_epochs: int = 10, save: str = "", folder: str = "",
         resume: bool = False, rank: int = 0, world: int = 1) -> Fit:  # fmt: skip
    """One fit; ``save`` is how it writes ``folder/last.ckpt`` ("last": ``ModelCheckpoint(save_last=True)``, "after":
    ``trainer.save_checkpoint`` after ``fit``, "step:K": after optimizer step K, "start": at its first micro-batch),
    ``resume`` resumes from it."""
    if world > 1:
        as_external_process(rank, world)
    pl.seed_everything(0)
    dataset = IndexedRegression(N)
    cb = SimiGrad(initial_batch_size=B0 * world, min_batch_size=B0 * world, target_similarity=0.5)
    audit = step_audit(dataset)
    callbacks: list[pl.Callback] = [cb, audit]
    kind, _, at = save.partition(":")
    path = os.path.join(folder, "last.ckpt")
    if kind == "last":
        callbacks.append(ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0))
    elif kind == "step":
        callbacks.append(SaveAtStep(path, step=int(at)))
    elif kind == "start":
        callbacks.append(SaveAtTheFirstBatch(path))
    strategy = DDPStrategy(process_group_backend="gloo") if world > 1 else "auto"
    t = trainer(devices=world, strategy=strategy, max_epochs=max_epochs, max_steps=max_steps, callbacks=callbacks,
                enable_checkpointing=kind == "last")  # fmt: skip
    model, ckpt_path = Regressor(), path if resume else None
    if loader == "litdata":
        t.fit(model, datamodule=LitDataModule(chunks), ckpt_path=ckpt_path)
    elif loader == "stateful":
        stream = StatefulDataLoader(IndexedStream(dataset, shuffle=True), batch_size=4, num_workers=2)
        t.fit(model, stream, ckpt_path=ckpt_path)
    else:
        t.fit(model, DataLoader(dataset, batch_size=4, shuffle=True), ckpt_path=ckpt_path)
    if kind == "after":
        t.save_checkpoint(path)
    return Fit([s.samples for s in audit.steps], [r["batch_size"] for r in cb.history],
               [p.detach().clone() for p in model.parameters()])  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(chunks) -> dict[str, Fit]:
    return {loader: _fit(loader, chunks, MAX_STEPS) for loader in LOADERS}


def _stop_on_a_boundary(whole: Fit, after: int) -> int:
    """A ``max_steps`` (B0-steps) that stops a fit where the uninterrupted one ended a step, after ``after`` steps."""
    trained = 0
    for step, samples in enumerate(whole.samples):
        trained += len(samples)
        if step + 1 >= after and trained % B0 == 0:
            return trained // B0
    raise AssertionError("no step boundary on a B0-step")


def _same(resumed: Fit, first: Fit, whole: Fit) -> None:
    assert first.rows + resumed.rows == whole.rows
    assert first.samples + resumed.samples == whole.samples
    for p, q in zip(whole.params, resumed.params, strict=True):
        assert torch.equal(p, q)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("save", ["last", "after", "step:4", "epoch"])
def test_a_resume_from_every_kind_of_checkpoint_continues_the_uninterrupted_run(tmp_path, chunks, uninterrupted,
                                                                                  loader: str, save: str):  # fmt: skip
    whole = uninterrupted[loader]
    assert len({len(s) for s in whole.samples}) >= 2  # the batch moved
    folder = str(tmp_path)
    if save == "epoch":  # the first epoch alone, saved after the fit: the epoch's end
        first = _fit(loader, chunks, MAX_STEPS, max_epochs=1, save="after", folder=folder)
    elif save.startswith("step"):
        first = _fit(loader, chunks, MAX_STEPS, save=save, folder=folder)
        first = Fit(first.samples[:4], first.rows[:4], [])
    else:  # stopped by `max_steps`, where the uninterrupted fit ended a step in the middle of its first epoch
        stop = _stop_on_a_boundary(whole, after=2)
        assert stop * B0 < N
        first = _fit(loader, chunks, stop, save=save, folder=folder)
    state = torch.load(os.path.join(folder, "last.ckpt"), weights_only=True)
    if save in ("last", "after"):
        assert state["epoch"] == 1 and 0 < state["callbacks"]["SimiGrad"]["counts"]["epoch_samples_done"] < N
    resumed = _fit(loader, chunks, MAX_STEPS, folder=folder, resume=True)
    _same(resumed, first, whole)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loader", LOADERS)
def test_a_stop_inside_a_window_trains_every_sample_once_per_epoch(tmp_path, chunks, uninterrupted, loader: str):
    """The stop cuts a window of the uninterrupted run: its samples drawn past the cut are trained after the resume."""
    whole, folder = uninterrupted[loader], str(tmp_path)
    trained = [sum(map(len, whole.samples[: k + 1])) for k in range(len(whole.samples))]
    stop = next(t // B0 + 1 for t in trained if t % B0 == 0 and (t + B0) not in trained and t >= 3 * B0)
    first = _fit(loader, chunks, stop, save="last", folder=folder)
    assert sum(map(len, first.samples)) == stop * B0  # the cut window: exactly what was left
    resumed = _fit(loader, chunks, MAX_STEPS, folder=folder, resume=True)
    samples = [i for step in first.samples + resumed.samples for i in step]
    assert len(samples) == MAX_STEPS * B0
    assert sorted(samples[:N]) == list(range(N)) and sorted(samples[N : 2 * N]) == list(range(N))


def _cut_under_ddp(rank: int, world: int, chunks: str, folder: str) -> tuple[list[list[int]], list[list[int]]]:
    first = _fit("litdata", chunks, 5, save="last", folder=folder, rank=rank, world=world)
    resumed = _fit("litdata", chunks, 24, folder=folder, resume=True, rank=rank, world=world)
    return first.samples, resumed.samples


@pytest.mark.timeout(400)
def test_a_cut_stream_window_resumes_every_rank_where_it_stopped(tmp_path, chunks):
    """Two DDP ranks over LitData: ``max_steps`` cuts a window of 16-sample B0-steps at 5 x 16 = 80 samples, inside a
    window, and each rank passes over the samples of its own share that were trained."""
    ranks = run_ok(_cut_under_ddp, 2, chunks, str(tmp_path), deadline_s=300, workers=True)
    first, resumed = ranks[0]
    assert ranks[1] == ranks[0]
    assert sum(map(len, first)) == 5 * 2 * B0
    samples = [i for step in first + resumed for i in step]
    assert len(samples) == 24 * 2 * B0
    assert sorted(samples[:N]) == list(range(N)) and sorted(samples[N : 2 * N]) == list(range(N))


def test_a_resume_with_max_steps_minus_one_starts_the_next_epoch_as_lightning_does(tmp_path, chunks, uninterrupted):
    """Lightning counts the epoch `max_steps` stopped as done; with ``max_steps=-1`` it trains the next one whole, and
    SimiGrad says what of the stopped epoch is left untrained."""
    folder = str(tmp_path)
    stop = _stop_on_a_boundary(uninterrupted["map"], after=2)
    first = _fit("map", chunks, stop, save="last", folder=folder)
    with pytest.warns(UserWarning, match=r"resumed with `max_steps=-1`, it starts the next\s+epoch"):
        resumed = _fit("map", chunks, -1, max_epochs=2, folder=folder, resume=True)
    samples = [i for step in resumed.samples for i in step]
    assert sum(map(len, first.samples)) == stop * B0
    assert sorted(samples) == list(range(N))  # epoch 1, whole; epoch 0's rest untrained, as in plain Lightning


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loader", ["litdata", "stateful"])
def test_a_checkpoint_written_before_a_resumed_fits_first_step_keeps_its_position(tmp_path, chunks, uninterrupted,
                                                                                  loader: str):  # fmt: skip
    """A fit resumed from a cut window writes a checkpoint before its first step: its position is the one it was
    resumed at, the samples of the cut window trained included, and a resume from it trains each sample once."""
    whole, first_folder, second_folder = uninterrupted[loader], str(tmp_path / "a"), str(tmp_path / "b")
    trained = [sum(map(len, whole.samples[: k + 1])) for k in range(len(whole.samples))]
    stop = next(t // B0 + 1 for t in trained if t % B0 == 0 and (t + B0) not in trained and t >= 3 * B0)
    first = _fit(loader, chunks, stop, save="last", folder=first_folder)
    os.makedirs(second_folder)
    os.replace(os.path.join(first_folder, "last.ckpt"), os.path.join(second_folder, "last.ckpt"))
    _fit(loader, chunks, stop + 3, save="start", folder=second_folder, resume=True)  # writes over it, then trains on
    third = _fit(loader, chunks, MAX_STEPS, folder=second_folder, resume=True)
    samples = [i for step in first.samples + third.samples for i in step]
    assert sorted(samples[:N]) == list(range(N)) and sorted(samples[N : 2 * N]) == list(range(N))
