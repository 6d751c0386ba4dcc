"""`loss_items` in a Fabric loop: every step's gradient is the mean over exactly the labelled tokens of every rank's
samples while the batch moves, at 1 and 2 processes (real gloo groups, Fabric's ``ddp_spawn``), with the loss written
as language-model code writes it (tests/support/token_modules.py: PyTorch's mean over a micro-batch's labelled
tokens). Without `loss_items` the same loop trains on a mean of micro-batch means, far off."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_simigrad.fabric import FabricSimiGrad
from tests.fabric.test_fabric_loop import grad_error
from tests.support.helpers import exit_without_finalization
from tests.support.token_modules import VOCAB, Sequences, TokenMeanLoss, TokenModel, labelled_tokens, pad_collate


def fit(fabric: Fabric, items: bool) -> dict:
    fabric.seed_everything(0)
    dataset = Sequences()
    model = TokenModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    world = fabric.world_size
    simigrad = FabricSimiGrad(
        fabric,
        target_similarity=0.5,
        loss_items=labelled_tokens if items else None,
        max_micro_batch_size=3,
        initial_batch_size=4 * world,
        max_batch_size=40,
    )
    simigrad.setup(model, optimizer, DataLoader(dataset, batch_size=3, shuffle=True, collate_fn=pad_collate))
    reference_loss = TokenMeanLoss(dataset)
    errors, sizes = [], []
    for window in simigrad.windows(max_epochs=2):
        fed: list[int] = []
        for batch in window:
            with fabric.no_backward_sync(model, enabled=window.accumulating):
                logits = model(batch["input_ids"])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))  # a token mean
                fabric.backward(window.scale(loss))
            fed += batch["index"].tolist()
        window.finish()
        every: list[list[int]] = [[] for _ in range(world)]
        if world > 1:
            dist.all_gather_object(every, fed)
        else:
            every = [fed]
        samples = [i for rank in every for i in rank]
        reference = copy.deepcopy(model.module if hasattr(model, "module") else model)
        reference.zero_grad()
        reference_loss(reference, samples).backward()
        errors.append(grad_error(model, reference))
        sizes.append(len(samples))
        window.step(optimizer)
        optimizer.zero_grad()
    exit_without_finalization()
    return {"errors": errors, "sizes": sizes, "history": [h["batch_size"] for h in simigrad.history]}


def launch(world: int, items: bool) -> dict:
    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp_spawn" if world > 1 else "auto")
    return fabric.launch(fit, items)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2])
def test_every_step_is_the_mean_over_exactly_its_labelled_tokens(world, master_port):
    result = launch(world, items=True)
    assert len(set(result["sizes"])) >= 3  # the batch moved
    assert result["history"] == result["sizes"]  # batch sizes count samples; the loss weighs items
    assert max(result["errors"]) < 1e-12, result["errors"]


@pytest.mark.timeout(600)
def test_without_loss_items_the_same_loop_is_off(master_port):
    # the property the test above checks can fail: weighing samples makes a step a mean of micro-batch means
    result = launch(1, items=False)
    assert max(result["errors"]) > 0.1
