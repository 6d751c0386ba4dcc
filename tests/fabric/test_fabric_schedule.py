"""Fixed schedules and replays in a Fabric loop (`FabricSimiGrad.following(fabric, BatchSizeSchedule(...))`): a ramp
decides every window's size, exactly, at 1 and 2 processes; a replay of a Fabric run's history trains the same batch
sizes step for step on the same samples; anything but a `BatchSizeSchedule` is refused with the fix."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from lightning_simigrad import BatchSizeSchedule, linear_ramp
from lightning_simigrad.fabric import FabricSimiGrad
from tests.fabric.test_fabric_loop import N, Net, train
from tests.support.helpers import IndexedRegression, exit_without_finalization

RAMP = linear_ramp(start=8, end=48, over=300)


def fit(fabric: Fabric, how: str, history: list[dict] | None) -> dict:
    fabric.seed_everything(0)
    dataset = IndexedRegression(N)
    model = Net(dropout=0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    if how == "adaptive":
        simigrad = FabricSimiGrad(fabric, target_similarity=0.9, max_micro_batch_size=6, history_size=None)
    elif how == "ramp":
        simigrad = FabricSimiGrad.following(fabric, BatchSizeSchedule(RAMP, max_micro_batch_size=6))
    else:
        assert history is not None
        simigrad = FabricSimiGrad.following(fabric, BatchSizeSchedule.from_history(history, max_micro_batch_size=6))
    simigrad.setup(model, optimizer, DataLoader(dataset, batch_size=4, shuffle=True))
    steps, errors = train(fabric, simigrad, model, optimizer, dataset, max_epochs=2)
    exit_without_finalization()
    return {"steps": steps, "errors": errors, "history": simigrad.history}


def launch(world: int, how: str, history: list[dict] | None = None) -> dict:
    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp_spawn" if world > 1 else "auto")
    return fabric.launch(fit, how, history)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2])
def test_a_ramp_decides_every_window_exactly(world, master_port):
    result = launch(world, "ramp")
    assert max(result["errors"]) < 1e-10
    trained = 0
    for number, step in enumerate(result["steps"]):
        epoch_left = N - trained % N
        if len(step) < epoch_left and epoch_left - len(step) >= len(step):  # not one of an epoch's last two windows
            assert len(step) == RAMP(trained), (number, trained, len(step))
        trained += len(step)
    assert trained == 2 * N
    assert [h["batch_size"] for h in result["history"]] == [len(s) for s in result["steps"]]


@pytest.mark.timeout(600)
def test_a_replay_of_a_fabric_run_trains_its_steps_again(master_port):
    adaptive = launch(1, "adaptive")
    sizes = [len(s) for s in adaptive["steps"]]
    assert len(set(sizes)) > 4  # the batch moved
    replay = launch(1, "replay", adaptive["history"])
    assert replay["steps"] == adaptive["steps"]  # the same windows, sample for sample
    assert max(replay["errors"]) < 1e-10


def test_anything_but_a_batch_size_schedule_is_refused():
    fabric = Fabric(accelerator="cpu", devices=1)
    fix = r"`schedule` must be a `BatchSizeSchedule`, got BatchSchedule.*BatchSizeSchedule\(linear_ramp"
    with pytest.raises(TypeError, match=fix):
        FabricSimiGrad.following(fabric, RAMP)
