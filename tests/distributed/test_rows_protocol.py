"""One failure protocol for every measurement that crosses ranks (:mod:`lightning_simigrad.measurement.rows`).

DDP (rank groups in the communication hook), FSDP1 (rank groups in the reduce-scatter on even W, the halves in
time reduced at the midpoint on odd W) and FSDP2 (the halves in time on shards) each end a window with one row
per rank, exchanged by the same all-gather and read by the same verdict. A fault inside one rank's halves, at the
second step, must end the fit on every rank with the same :class:`~lightning_simigrad.MeasurementError`, at the
same step, before the optimizer steps; the original error chained on the rank where it happened.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_simigrad import MeasurementError, SimiGrad
from tests.support.fsdp_modules import FSDPRegressor, as_external_process, fsdp1, strategy
from tests.support.helpers import IndexedRegression, Regressor, trainer


class FailOnce(pl.Callback):
    """Makes the measurement's halves fail on ``rank`` when they finish the window of optimizer step ``step``."""

    def __init__(self, simigrad: SimiGrad, rank: int, step: int) -> None:
        self.simigrad, self.rank, self.step = simigrad, rank, step

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank != self.rank:
            return
        halves = self.simigrad.run.measurement.halves
        finish = halves.finish

        def failing():  # type: ignore[no-untyped-def]
            if trainer.global_step == self.step:
                raise FloatingPointError("injected fault in this rank's products")
            return finish()

        halves.finish = failing


def _failing_fit(rank: int, world: int, training: str) -> dict:
    as_external_process(rank, world)
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.9, max_micro_batch_size=5)
    if training == "ddp":
        module, parallel = Regressor(), DDPStrategy(process_group_backend="gloo")
    elif training == "fsdp1":
        module, parallel = Regressor(), fsdp1(world)
    else:
        module, parallel = FSDPRegressor(), strategy(world)
    t = trainer(devices=world, strategy=parallel, max_epochs=1, callbacks=[cb, FailOnce(cb, world - 1, step=1)])
    try:
        t.fit(module, DataLoader(IndexedRegression(60), batch_size=5, shuffle=True))
    except MeasurementError as error:
        cause = error.__cause__
        return dict(error=str(error), cause=repr(cause) if cause else None, steps=len(cb.history), at=t.global_step)
    return dict(error=None, steps=len(cb.history))


@pytest.mark.parametrize("world", [2, 3, 4], ids=["W=2", "W=3", "W=4"])
@pytest.mark.parametrize("training", ["ddp", "fsdp1", "fsdp2"])
@pytest.mark.timeout(240)
def test_a_fault_on_one_rank_raises_the_same_error_on_every_rank_at_the_same_step(training, world, run_ok):
    ranks = run_ok(_failing_fit, world, training, deadline_s=200)
    failing = world - 1
    assert all(r["error"] is not None for r in ranks), ranks  # no rank trained on
    assert len({r["error"] for r in ranks}) == 1, ranks  # the same message everywhere
    assert f"failed on rank {failing} (in collect(), before its all-gather)" in ranks[0]["error"]
    assert "Every rank raises this error at the same step" in ranks[0]["error"]
    assert "injected fault" in ranks[failing]["cause"]  # chained where it happened, nowhere else
    assert all(r["cause"] is None for r in ranks[:failing])
    # the first step was measured and taken; the second failed before any rank's optimizer stepped
    assert [(r["steps"], r["at"]) for r in ranks] == [(1, 1)] * world
