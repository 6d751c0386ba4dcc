"""A unit of the user's own: every sample carries a weight (here an image's pixels), batch sizes count it.

The unit is one object given to the callback (``SimiGrad(unit=Unit("pixels", per_sample=...))``); nothing else in the
library knows it. Windows are planned to budgets of pixels, the logged batch is each step's pixels (its samples
beside it, the fit's pixels as ``simigrad/pixels_seen``), every sample is trained once per epoch, and every step's
gradient is the mean over exactly its samples -- on one process and on two DDP ranks (gloo).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad, Unit
from tests.support.distributed import run_ok
from tests.support.fsdp_modules import as_external_process
from tests.support.helpers import IndexedRegression, Regressor, step_audit, trainer

N, EPOCHS = 120, 2
PIXELS = [(8 + i % 5) * (8 + i % 3) for i in range(N)]  # an image's height x width, 64 to 120


def _fit(rank: int, world: int) -> dict:
    if world > 1:
        as_external_process(rank, world)
    pl.seed_everything(0)
    dataset = IndexedRegression(N)
    cb = SimiGrad(0.3, unit=Unit("pixels", per_sample=PIXELS), initial_batch_size=1200, max_micro_batch_size=6)
    audit = step_audit(dataset)
    strategy = DDPStrategy(process_group_backend="gloo") if world > 1 else "auto"
    t = trainer(devices=world, strategy=strategy, max_epochs=EPOCHS, callbacks=[cb, audit])
    t.fit(Regressor(), DataLoader(dataset, batch_size=6, shuffle=True))
    return dict(
        rows=cb.history,
        samples=[step.samples for step in audit.steps],
        errors=[step.grad_rel_error for step in audit.steps],
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_a_unit_of_the_users_own_counts_its_weight_and_every_step_stays_exact(world: int) -> None:
    ranks = [_fit(0, 1)] if world == 1 else run_ok(_fit, world, deadline_s=240)
    first = ranks[0]
    assert all(r["samples"] == first["samples"] for r in ranks)
    sizes = [row["batch_size"] for row in first["rows"]]
    assert sizes == [sum(PIXELS[i] for i in step) for step in first["samples"]]  # each step's pixels
    assert [row["batch_samples"] for row in first["rows"]] == [len(step) for step in first["samples"]]
    assert [row["pixels_seen"] for row in first["rows"]][-1] == EPOCHS * sum(PIXELS)
    assert len(set(sizes[: len(sizes) // 2])) >= 3  # the batch moved
    flat = [i for step in first["samples"] for i in step]
    assert sorted(flat) == sorted(list(range(N)) * EPOCHS)  # every sample once per epoch
    assert max(max(r["errors"]) for r in ranks) < 1e-12  # the mean over exactly its samples
