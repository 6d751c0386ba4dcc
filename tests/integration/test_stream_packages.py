"""The stream packages users train from, at one process and on two DDP ranks (gloo): LitData's
``StreamingDataset``/``StreamingDataLoader`` built in a ``LightningDataModule``, and a Hugging Face
``datasets.IterableDataset`` (``split_dataset_by_node`` on two ranks) through torchdata's ``StatefulDataLoader``.

Every sample once per pass, every step's gradient the mean over exactly its samples, the batch moving, and a
mid-epoch kill-and-resume from the checkpoint continuing step for step.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_simigrad import SimiGrad
from tests.support.distributed import run_ok
from tests.support.fsdp_modules import as_external_process
from tests.support.helpers import IndexedRegression, Regressor, step_audit, trainer
from tests.support.stream_packages import LitDataModule, hf_collate, hf_stream, write_litdata_chunks
from tests.support.streams import SaveAtStep, each_sample_once

N = 150
EPOCHS = 2


@pytest.fixture(scope="module")
def chunks(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("litdata") / "chunks")
    write_litdata_chunks(path, N)
    return path


def _fit(rank: int, world: int, package: str, chunks: str | None, save: str | None = None,
         ckpt_path: str | None = None) -> dict:  # fmt: skip
    if world > 1:
        as_external_process(rank, world)
    pl.seed_everything(0)
    dataset = IndexedRegression(N)
    cb = SimiGrad(initial_batch_size=8 * world, target_similarity=0.3)
    audit = step_audit(dataset)
    model = Regressor()
    callbacks = [cb, audit] + ([SaveAtStep(save, step=3)] if save else [])
    strategy = DDPStrategy(process_group_backend="gloo") if world > 1 else "auto"
    t = trainer(devices=world, strategy=strategy, max_epochs=EPOCHS, callbacks=callbacks)
    if package == "litdata":
        t.fit(model, datamodule=LitDataModule(chunks), ckpt_path=ckpt_path)
    else:
        loader = StatefulDataLoader(hf_stream(N, rank, world), batch_size=4, num_workers=2, collate_fn=hf_collate)
        t.fit(model, loader, ckpt_path=ckpt_path)
    return dict(
        samples=[step.samples for step in audit.steps],
        errors=[step.grad_rel_error for step in audit.steps],
        identical=all(step.ranks_identical for step in audit.steps),
        rows=[(r["step"], r["batch_size"], r["samples_seen"]) for r in cb.history],
        params=[p.detach().clone() for p in model.parameters()],
    )


def _run(world: int, *args) -> dict:
    if world == 1:
        return _fit(0, 1, *args)
    ranks = run_ok(_fit, world, *args, deadline_s=240, workers=True)
    assert all(r["samples"] == ranks[0]["samples"] for r in ranks) and all(r["identical"] for r in ranks)
    return ranks[0]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("package", ["litdata", "datasets"])
def test_a_stream_package_trains_exactly_and_resumes_step_for_step(tmp_path, chunks, package: str, world: int):
    path = str(tmp_path / "mid.ckpt")
    whole = _run(world, package, chunks, path)
    each_sample_once(whole["samples"], N, EPOCHS)
    assert max(whole["errors"]) < 1e-12
    assert len({len(s) for s in whole["samples"][:-1]}) >= 2  # the batch moved
    state = torch.load(path, weights_only=True)["callbacks"]["SimiGrad"]
    assert 0 < state["counts"]["epoch_samples_done"] < N and len(state["stream"]) == world
    resumed = _run(world, package, chunks, None, path)  # a new process group: as after a kill
    assert resumed["rows"] == whole["rows"][3:]
    assert resumed["samples"] == whole["samples"][3:]
    for p, q in zip(whole["params"], resumed["params"], strict=True):
        assert torch.equal(p, q)
