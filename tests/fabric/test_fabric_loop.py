"""SimiGrad in a Fabric loop: every step's gradient is the mean over exactly its samples while the batch moves, every
sample once per epoch, at 1, 2 and 3 processes (real gloo groups, Fabric's ``ddp_spawn``); a mid-epoch
``fabric.save`` / ``fabric.load`` continues step for step; the batch settles at B* on the known-noise problem."""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

from lightning_simigrad import equilibrium_batch_size
from lightning_simigrad.fabric import FabricSimiGrad
from tests.support.helpers import NOISE_SCALE, IndexedRegression, exit_without_finalization, known_noise_dataset

N = 203  # an odd count: uneven epoch tails


class Net(nn.Module):
    def __init__(self, dropout: float = 0.2) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, 1)).double()

    def forward(self, x):
        return self.net(x)


def mean_loss(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def gather(values: list[int]) -> list[int]:
    if not dist.is_initialized():
        return values
    every: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, values)
    return [i for rank in every for i in rank]


def grad_error(model: nn.Module, reference: nn.Module) -> float:
    """|g - g_ref| / |g_ref| over every parameter's gradient."""
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    r = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    return float((g - r).norm() / r.norm())


def train(
    fabric: Fabric,
    simigrad: FabricSimiGrad,
    model: Any,
    optimizer: Any,
    dataset: IndexedRegression,
    max_epochs: int,
    audit: bool = True,
    after_step: Callable[[], None] | None = None,
) -> tuple[list[list[int]], list[float]]:
    """The loop of docs/fabric.md, with an audit of every step: the samples every rank fed, and (``audit``) the
    gradient against the mean loss's over exactly those samples (dropout off for the reference: the audit runs the
    model in eval)."""
    steps, errors = [], []
    for window in simigrad.windows(max_epochs=max_epochs):
        fed: list[int] = []
        for idx, x, y in window:
            with fabric.no_backward_sync(model, enabled=window.accumulating):
                fabric.backward(window.scale(mean_loss(model, x, y)))
            fed += idx.tolist()
        window.finish()
        every = gather(fed)
        if audit:  # the reference gradient at the same parameters
            reference = copy.deepcopy(model.module if hasattr(model, "module") else model)
            reference.zero_grad()
            mean_loss(reference, dataset.x[every], dataset.y[every]).backward()
            errors.append(grad_error(model, reference))
        steps.append(sorted(every))
        window.step(optimizer)
        optimizer.zero_grad()
        if after_step is not None:
            after_step()
    return steps, errors


def fit(fabric: Fabric, max_epochs: int, save_at: int | None, path: str | None, load: str | None) -> dict:
    fabric.seed_everything(0)
    dataset = IndexedRegression(N)
    model = Net(dropout=0.0 if save_at is None and load is None else 0.2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    simigrad = FabricSimiGrad(fabric, target_similarity=0.9, smoothing=0.5, max_batch_size=120, max_micro_batch_size=6)
    simigrad.setup(model, optimizer, DataLoader(dataset, batch_size=4, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "simigrad": simigrad}
    if load is not None:
        fabric.load(load, state)

    def save() -> None:
        if save_at is not None and len(simigrad.history) == save_at:
            fabric.save(path, state)

    audit = save_at is None and load is None
    steps, errors = train(fabric, simigrad, model, optimizer, dataset, max_epochs, audit, save)
    # plain lists: tensors would travel back from a spawned process through shared memory it takes with it
    weights = {k: v.detach().reshape(-1).tolist() for k, v in model.state_dict().items()}
    exit_without_finalization()
    return {"history": simigrad.history, "steps": steps, "errors": errors, "weights": weights}


def launch(
    world: int, max_epochs: int = 2, save_at: int | None = None, path: str | None = None, load: str | None = None
):
    strategy = "ddp_spawn" if world > 1 else "auto"
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    return fabric.launch(fit, max_epochs, save_at, path, load)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_step_is_the_mean_over_exactly_its_samples_and_every_sample_trains_once_an_epoch(world, master_port):
    result = launch(world)
    assert max(result["errors"]) < 1e-10, result["errors"]
    sizes = [h["batch_size"] for h in result["history"]]
    assert len(set(sizes)) > 4  # the batch moved
    by_epoch: list[list[int]] = [[], []]
    start = 0
    for step in result["steps"]:  # a window never spans two epochs
        by_epoch[start // N] += step
        start += len(step)
    assert [sorted(fed) for fed in by_epoch] == [list(range(N))] * 2  # every sample once per epoch
    assert sum(len(s) for s in result["steps"]) == 2 * N


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2])
def test_a_mid_epoch_fabric_checkpoint_resumes_step_for_step(tmp_path, world, master_port):
    path = str(tmp_path / "mid.ckpt")
    whole = launch(world, save_at=7, path=path)
    resumed = launch(world, load=path)
    assert resumed["steps"] == whole["steps"][7:]
    # the same rows; similarities and noise scales to rounding: DDP regroups its gradient buckets after a process's
    # first backward, which changes the order the measurement adds its per-bucket sums in (the gradients are unchanged)
    rounded = ("similarity", "noise_scale")
    exact = [{k: v for k, v in h.items() if k not in rounded} for h in resumed["history"]]
    assert exact == [{k: v for k, v in h.items() if k not in rounded} for h in whole["history"][7:]]
    for key in rounded:
        ours, theirs = [h[key] for h in resumed["history"]], [h[key] for h in whole["history"][7:]]
        assert ours == pytest.approx(theirs, rel=1e-12, nan_ok=True)
    assert resumed["weights"] == whole["weights"]  # bitwise


class LinearLoss(nn.Module):
    """Sample i's loss is w . v_i, so its gradient is v_i whatever w is (tests/integration/test_equilibrium.py)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(dim))

    def forward(self, v):  # through the strategy's wrapper: under DDP its reducer sees the backward
        return (v @ self.w).mean()


def settle(fabric: Fabric) -> list[float]:
    dataset = known_noise_dataset()
    model = LinearLoss(dataset.tensors[0].shape[1])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = fabric.setup(model, optimizer)
    simigrad = FabricSimiGrad(
        fabric, target_similarity=0.8, max_micro_batch_size=256, schedule_by_samples=False, history_size=None
    )
    simigrad.setup(model, optimizer, DataLoader(dataset, batch_size=32, shuffle=True))
    for window in simigrad.windows(max_steps=160):
        for (v,) in window:
            with fabric.no_backward_sync(model, enabled=window.accumulating):
                fabric.backward(window.scale(model(v)))
        window.step(optimizer)
        optimizer.zero_grad()
    exit_without_finalization()
    return [h["batch_size"] for h in simigrad.history]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2])
def test_the_batch_settles_at_b_star_on_the_known_noise_problem(world, master_port):
    expected = equilibrium_batch_size(NOISE_SCALE, 0.8)  # 200
    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp_spawn" if world > 1 else "auto")
    sizes = fabric.launch(settle)
    settled = statistics.median(sizes[-60:])
    assert abs(settled - expected) <= 0.15 * expected, (settled, expected)


def test_an_optimizer_over_parameters_the_model_no_longer_has_is_refused():
    fabric = Fabric(accelerator="cpu", devices=1)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    stale = torch.optim.SGD(Net().parameters(), lr=0.1)
    simigrad = FabricSimiGrad(fabric, target_similarity=0.5)
    with pytest.raises(ValueError, match="4 of the optimizer.s parameters are not the model.s.*setup_module"):
        simigrad.setup(model, stale, DataLoader(IndexedRegression(20), batch_size=4))
    simigrad.setup(model, optimizer, DataLoader(IndexedRegression(20), batch_size=4))  # its own: accepted
