"""Devices that follow the batch, in one process: the wanted world size logged every step, the request written at a
step's boundary with an exact checkpoint beside it, and a SIGTERM in the middle of a window saving one that loses no
finished step. (The restarts at another world size under real torchrun agents:
tests/distributed/test_elastic_restarts.py.)"""

from __future__ import annotations

import math
import os
import signal

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_simigrad import Elastic, ResizeRequest, SimiGrad
from tests.support.helpers import IndexedRegression, Regressor, StepSamples, trainer

N = 600


class SigtermInsideWindow(pl.Callback):
    """Sends this process SIGTERM after the first micro-batch of the window that follows optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step, self.after = step, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.after += 1
            if self.after == 2:  # the first is the micro-batch that stepped
                os.kill(os.getpid(), signal.SIGTERM)


def fit(root, on_request="continue", callbacks=(), ckpt_path=None, max_epochs=2):
    pl.seed_everything(0)
    model = Regressor(dropout=0.2)
    elastic = Elastic(max_accumulation=2, patience=3, on_request=on_request, dirpath=root / "elastic")
    cb = SimiGrad(target_similarity=0.95, max_batch_size=256, elastic=elastic)
    steps = StepSamples()
    t = trainer(callbacks=[cb, steps, *callbacks], max_epochs=max_epochs, default_root_dir=root)
    loader = DataLoader(IndexedRegression(N), batch_size=16, shuffle=True)
    t.fit(model, loader, ckpt_path=ckpt_path)
    return cb, steps.steps, model


def rows(history) -> list[str]:
    return [repr(sorted(h.items())) for h in history]


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return fit(tmp_path_factory.mktemp("whole"))


@pytest.mark.timeout(300)
def test_the_wanted_world_follows_the_batch_and_is_logged_every_step(whole):
    cb, _, _ = whole
    history = cb.history
    assert all("world_size_wanted" in h for h in history)
    # micro-batches of 16 (the loader's), at most 2 a rank: the next step's batch b wants ceil(b / 32) ranks, and the
    # wanted size shrinks only once the batch fits on half of it
    wanted = [int(h["world_size_wanted"]) for h in history]
    asked = [int(h["batch_size"]) for h in history[1:]] + [None]
    for w, b in zip(wanted, asked):
        if b is not None:
            assert w >= math.ceil(b / 32)
    assert max(wanted) >= 4 and min(wanted) == 1  # the batch grew from 16 past 4 x 32
    assert any(later != earlier for earlier, later in zip(wanted, wanted[1:]))


@pytest.mark.timeout(300)
def test_a_request_stops_the_fit_at_a_step_boundary_and_its_checkpoint_resumes_exactly(tmp_path, whole):
    reference, reference_steps, reference_model = whole
    stopped, stopped_steps, _ = fit(tmp_path / "stopped", on_request="stop")
    request = ResizeRequest.read(tmp_path / "stopped" / "elastic" / Elastic.REQUEST)
    k = request.step
    assert 0 < k == len(stopped.history) < len(reference.history)  # the fit stopped at the request's step
    assert stopped_steps == reference_steps[:k] and rows(stopped.history) == rows(reference.history[:k])
    assert request.nodes == request.world_size >= 2 * request.current_nodes  # resize_factor 2, one rank a node
    assert request.current_world_size == 1 and request.batch_size > 2 * 16  # more than 2 micro-batches of 16
    assert "max_accumulation = 2" in request.reason
    assert request.checkpoint == os.fspath((tmp_path / "stopped" / "elastic" / Elastic.CHECKPOINT).resolve())
    resumed, resumed_steps, resumed_model = fit(tmp_path / "resumed", ckpt_path=request.checkpoint)
    assert resumed_steps == reference_steps[k:]  # every step after the request averages the same samples
    assert rows(resumed.history) == rows(reference.history[k:])
    assert same_weights(resumed_model, reference_model)


@pytest.mark.timeout(300)
def test_a_request_calls_the_users_function_on_the_written_checkpoint(tmp_path):
    seen: list[ResizeRequest] = []

    def manager(request):
        assert os.path.exists(request.checkpoint)  # written before the manager hears of it
        seen.append(request)

    cb, steps, _ = fit(tmp_path, on_request=manager, max_epochs=1)
    assert seen and seen[-1] == ResizeRequest.read(tmp_path / "elastic" / Elastic.REQUEST)
    assert len(steps) == len(cb.history)  # the fit went on to its end
    assert len({r.nodes for r in seen}) == len(seen)  # one request per wanted size


@pytest.mark.timeout(300)
def test_a_sigterm_inside_a_window_saves_a_checkpoint_that_loses_no_finished_step(tmp_path, whole):
    reference, reference_steps, reference_model = whole
    with pytest.raises(SystemExit):  # Lightning's SIGTERMException
        fit(tmp_path / "stopped", callbacks=[SigtermInsideWindow(step=7)])
    checkpoint = tmp_path / "stopped" / "elastic" / Elastic.CHECKPOINT
    state = torch.load(checkpoint, weights_only=False)
    assert state["global_step"] == 7 and state["callbacks"]["SimiGrad"]["counts"]["steps"] == 7
    resumed, resumed_steps, resumed_model = fit(tmp_path / "resumed", ckpt_path=checkpoint)
    assert resumed_steps == reference_steps[7:]  # the half-trained window trains again from its start
    assert rows(resumed.history) == rows(reference.history[7:])
    assert same_weights(resumed_model, reference_model)


@pytest.mark.timeout(300)
def test_ckpt_path_last_resumes_from_the_request_checkpoint_beside_a_model_checkpoints(tmp_path):
    def fit_last(on_request):
        pl.seed_everything(0)
        elastic = Elastic(max_accumulation=2, patience=3, on_request=on_request)
        every = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1000)
        cb = SimiGrad(0.95, max_batch_size=256, elastic=elastic)
        t = trainer(callbacks=[cb, every], max_epochs=1, default_root_dir=tmp_path, enable_checkpointing=True)
        t.fit(Regressor(), DataLoader(IndexedRegression(N), batch_size=16, shuffle=True), ckpt_path="last")
        return cb

    first = fit_last("stop")  # nothing to resume yet: Lightning warns and starts afresh
    request = ResizeRequest.read(tmp_path / "ckpts" / Elastic.REQUEST)
    assert os.path.dirname(request.checkpoint) == os.fspath((tmp_path / "ckpts").resolve())
    again = fit_last("continue")
    assert again.history[0]["step"] == request.step == len(first.history)
