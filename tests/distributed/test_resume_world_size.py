"""A checkpoint written on W ranks resumes on W' ranks (1 -> 2, 2 -> 1, 2 -> 3, 4 -> 2; real gloo groups).

The source fit stops after 6 optimizer steps, in the middle of its first epoch, with a checkpoint. The fit
resumed from it on another number of ranks must train the rest of that epoch and the next one, every sample
exactly once across the new ranks, and carry over what SimiGrad decided: the controller, the batch sizes it
had planned, the samples seen, and B0 (so the learning-rate factor sqrt(B / B0) keeps its meaning).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad
from tests.support.helpers import IndexedRegression, Regressor, trainer

pytestmark = pytest.mark.slow  # seven fits, five of them on 2 to 4 spawned processes: `pytest -m slow`

N = 203
STOP = 6  # optimizer steps the source fit trains


class Record(pl.Callback):
    """After SimiGrad: the samples this rank fed in every step, and the controller the fit started from."""

    def __init__(self, out: Path, stop: int | None = None) -> None:
        self.out, self.stop = out, stop

    def on_train_start(self, trainer, pl_module):
        self.simigrad = next(c for c in trainer.callbacks if isinstance(c, SimiGrad))
        self.controller = self.simigrad.controller.state_dict()
        self.fed: list[int] = []
        self.steps: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.simigrad.local_samples:  # 0: a zero-weight padding sample
            self.fed += batch[0].tolist()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append(dict(epoch=self.simigrad.schedule.current.epoch, samples=self.fed))
        self.fed = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.stop is not None and trainer.global_step == self.stop:
            trainer.should_stop = True  # after the checkpoint callback (listed before) has saved this step

    def on_train_end(self, trainer, pl_module):
        payload = dict(controller=self.controller, steps=self.steps, history=self.simigrad.history)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(payload))


def fit(out: Path, world: int, ckpt_path=None) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.9, max_batch_size=120, max_micro_batch_size=6)
    callbacks = [cb, ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=STOP)]
    callbacks.append(Record(out, stop=STOP if ckpt_path is None else None))
    spawn = dict(strategy="ddp_spawn") if world > 1 else {}
    t = trainer(devices=world, max_epochs=2, enable_checkpointing=True, callbacks=callbacks, **spawn)
    # 4 samples per rank: B0 is 4 x world unless a checkpoint says otherwise
    t.fit(Regressor(), DataLoader(IndexedRegression(N), batch_size=4, shuffle=True), ckpt_path=ckpt_path)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def steps_of(ranks: list[dict]) -> list[dict]:
    """Every step with the samples of all ranks together."""
    assert all(r["history"] == ranks[0]["history"] for r in ranks)  # every rank took the same decisions
    steps = []
    for per_rank in zip(*(r["steps"] for r in ranks), strict=True):
        steps.append(dict(epoch=per_rank[0]["epoch"], samples=[i for s in per_rank for i in s["samples"]]))
    return steps


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """Source fits by world size, run once each and shared by the resumes."""
    cache: dict[int, tuple] = {}

    def source(world: int) -> tuple:
        if world not in cache:
            out = tmp_path_factory.mktemp(f"source{world}")
            ranks = fit(out, world)
            checkpoint = torch.load(out / f"step={STOP}.ckpt", weights_only=False)
            cache[world] = (out / f"step={STOP}.ckpt", checkpoint["callbacks"]["SimiGrad"], steps_of(ranks))
        return cache[world]

    return source


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world,resumed_world", [(1, 2), (2, 1), (2, 3), (4, 2)])
def test_a_checkpoint_resumes_on_another_number_of_ranks(tmp_path, sources, world, resumed_world):
    path, state, before = sources(world)
    assert state["run"]["world_size"] == world and state["counts"]["steps"] == STOP
    assert state["counts"]["epoch_samples_done"] < N
    ranks = fit(tmp_path, resumed_world, ckpt_path=path)
    after = steps_of(ranks)
    history = ranks[0]["history"]
    # the rest of the first epoch and the whole second one, every sample once across the new ranks
    trained = before + after
    for epoch in (0, 1):
        assert sorted(i for s in trained if s["epoch"] == epoch for i in s["samples"]) == list(range(N))
    assert len(history) == len(after)
    assert all(len(s["samples"]) == h["batch_size"] for s, h in zip(after, history, strict=True))
    # what SimiGrad had decided carries over
    assert ranks[0]["controller"] == state["controller"]
    first = history[0]
    planned = state["schedule"]["planned"][0] if state["schedule"]["planned"] else state["schedule"]["batch_size"]
    # the window planned before the checkpoint, raised to the smallest batch the new world size measures: two
    # micro-batches on one process, one sample per rank under DDP (`world_size * min_micro_batches`)
    smallest = 2 if resumed_world == 1 else resumed_world
    assert first["batch_size"] == max(planned, smallest)
    assert first["step"] == STOP and first["samples_seen"] == state["counts"]["samples_seen"] + first["batch_size"]
    b0 = state["run"]["initial_batch_size"]
    assert b0 == 4 * world  # the checkpoint's B0, not 4 x the new world size
    assert all(h["lr_scale"] == pytest.approx(math.sqrt(h["batch_size"] / b0)) for h in history)
    assert len({h["batch_size"] for h in history}) > 3  # and the controller keeps adapting on the new ranks
