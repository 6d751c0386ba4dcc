"""Streams on DDP ranks (gloo): every rank re-batches its own part of the stream into its share of each window.

Every sample once per pass, every step's gradient the mean over exactly its samples and the same on every rank, at
W = 2 and 3, with and without workers; a rank whose stream runs dry first ends the pass with the others (its share
fed with zero weight, or, under ``drop_last``, the pass ended for all at once), with nothing trained twice and no
rank waiting; a mid-epoch resume of a stateful loader continues step for step, and one on another world size is
refused.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_simigrad import SimiGrad
from tests.support.distributed import run_ok
from tests.support.fsdp_modules import as_external_process
from tests.support.helpers import IndexedRegression, Regressor, step_audit, trainer
from tests.support.streams import IndexedStream, SaveAtStep, each_sample_once

N = 150
EPOCHS = 2
LOADERS = {"DataLoader": DataLoader, "StatefulDataLoader": StatefulDataLoader}


def _fit(rank: int, world: int, loader: str, workers: int, uneven: int = 0, drop_last: bool = False,
         save: str | None = None, ckpt_path: str | None = None) -> dict:  # fmt: skip
    as_external_process(rank, world)
    pl.seed_everything(0)
    dataset = IndexedRegression(N)
    cb = SimiGrad(initial_batch_size=8 * world, target_similarity=0.3)
    audit = step_audit(dataset)
    model = Regressor()
    callbacks = [cb, audit] + ([SaveAtStep(save, step=3)] if save else [])
    t = trainer(devices=world, strategy=DDPStrategy(process_group_backend="gloo"), max_epochs=EPOCHS,
                callbacks=callbacks)  # fmt: skip
    stream = IndexedStream(dataset, shuffle=True, uneven=uneven)
    t.fit(model, LOADERS[loader](stream, batch_size=4, num_workers=workers, drop_last=drop_last), ckpt_path=ckpt_path)
    return dict(
        samples=[step.samples for step in audit.steps],
        errors=[step.grad_rel_error for step in audit.steps],
        identical=all(step.ranks_identical for step in audit.steps),
        rows=[(r["step"], r["batch_size"], r["samples_seen"]) for r in cb.history],
        params=[p.detach().clone() for p in model.parameters()],
    )


def _check_exact(ranks: list[dict]) -> list[list[int]]:
    assert all(r["samples"] == ranks[0]["samples"] for r in ranks)  # every rank audited the same steps
    assert max(ranks[0]["errors"]) < 1e-12 and all(r["identical"] for r in ranks)
    return ranks[0]["samples"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world", "loader", "workers"),
    [(2, "DataLoader", 0), (2, "StatefulDataLoader", 2), (3, "DataLoader", 2)],
)
def test_ranks_rebatch_their_streams_into_exact_windows(world: int, loader: str, workers: int) -> None:
    samples = _check_exact(run_ok(_fit, world, loader, workers, deadline_s=240, workers=True))
    each_sample_once(samples, N, EPOCHS)
    sizes = [len(s) for s in samples]
    assert len(set(sizes[:-1])) >= 2  # the batch moved
    assert all(size % (4 * world) == 0 for size in sizes[:3])  # whole loader batches on every rank


@pytest.mark.timeout(300)
def test_a_rank_whose_stream_runs_dry_first_ends_the_pass_with_the_others() -> None:
    short = 30  # the last rank's stream holds 30 samples fewer: it feeds zero-weight batches while rank 0 finishes
    samples = _check_exact(run_ok(_fit, 2, "DataLoader", 2, short, deadline_s=240, workers=True))
    per_pass = N - short
    flat = [i for s in samples for i in s]
    assert len(flat) == EPOCHS * per_pass and len(set(flat[:per_pass])) == per_pass  # all of them, none twice


@pytest.mark.timeout(300)
def test_under_drop_last_the_pass_ends_for_every_rank_at_the_first_window_a_rank_cannot_fill() -> None:
    samples = _check_exact(run_ok(_fit, 2, "DataLoader", 0, 30, True, deadline_s=240, workers=True))
    flat = [i for s in samples for i in s]
    assert len(flat) == len(set(flat[: len(flat) // 2])) * 2  # each pass the same number, none twice in a pass
    assert len(flat) // EPOCHS <= N - 30  # never more than the shorter shards allow


@pytest.mark.timeout(400)
def test_a_mid_epoch_resume_on_two_ranks_continues_step_for_step(tmp_path) -> None:
    path = str(tmp_path / "mid.ckpt")
    whole = run_ok(_fit, 2, "StatefulDataLoader", 2, 0, False, path, deadline_s=240, workers=True)
    state = torch.load(path, weights_only=True)["callbacks"]["SimiGrad"]
    assert 0 < state["counts"]["epoch_samples_done"] < N and len(state["stream"]) == 2
    resumed = run_ok(_fit, 2, "StatefulDataLoader", 2, 0, False, None, path, deadline_s=240, workers=True)
    assert resumed[0]["rows"] == whole[0]["rows"][3:]
    assert resumed[0]["samples"] == whole[0]["samples"][3:]
    for p, q in zip(whole[0]["params"], resumed[0]["params"], strict=True):
        assert torch.equal(p, q)


@pytest.mark.timeout(300)
def test_a_mid_epoch_resume_on_another_world_size_is_refused(tmp_path) -> None:
    path = str(tmp_path / "mid.ckpt")
    run_ok(_fit, 2, "StatefulDataLoader", 0, 0, False, path, deadline_s=240, workers=True)
    pl.seed_everything(0)
    dataset = IndexedRegression(N)
    t = trainer(callbacks=[SimiGrad(initial_batch_size=16, target_similarity=0.3)], max_epochs=EPOCHS)
    with pytest.raises(RuntimeError, match=r"holds the loader positions of 2 process\(es\); this fit runs 1"):
        t.fit(Regressor(), StatefulDataLoader(IndexedStream(dataset), batch_size=4), ckpt_path=path)
