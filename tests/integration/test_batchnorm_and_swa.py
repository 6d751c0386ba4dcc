"""BatchNorm and stochastic weight averaging with SimiGrad added: no one-sample micro-batch plain Lightning would not
feed (on one process and on two under ``ddp_spawn``, whose results reach the launching process), and SWA's
BatchNorm epoch without an optimizer step.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad
from tests.support.helpers import trainer
from tests.support.lightning_features import StepsPerEpoch, ValidationsPerEpoch
from tests.support.user_modules import BatchNormNet, RandomDataset


@pytest.mark.parametrize("length,batch_size", [(35, 16), (33, 16), (129, 8), (17, 8)])
def test_batchnorm_never_sees_a_one_sample_micro_batch_plain_lightning_would_not_feed(length, batch_size):
    pl.seed_everything(0)
    model = BatchNormNet()
    cb = SimiGrad(target_similarity=0.9)
    t = trainer(callbacks=[cb], max_epochs=4)
    t.fit(model, DataLoader(RandomDataset(32, length), batch_size=batch_size, shuffle=True))  # crashes on a 1
    assert min(len(m) for m in model.micro_batches) >= 2
    assert cb.samples_seen == 4 * length


class RankDump(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        cb = next(c for c in trainer.callbacks if isinstance(c, SimiGrad))
        payload = dict(micro=pl_module.micro_batches, history=cb.history)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(payload))


@pytest.mark.timeout(120)
def test_batchnorm_tails_on_two_processes_and_ddp_spawn_results_reach_the_launching_process(tmp_path):
    pl.seed_everything(0)
    model = BatchNormNet()
    cb = SimiGrad(target_similarity=0.9)
    t = trainer(devices=2, strategy="ddp_spawn", max_epochs=3, callbacks=[cb, RankDump(tmp_path)])
    # plain Lightning: 19 samples per rank, fed as 8, 8, 3
    t.fit(model, DataLoader(RandomDataset(32, 37), batch_size=8, shuffle=True))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert min(len(m) for r in ranks for m in r["micro"]) >= 2
    assert sorted(i for r in ranks for m in r["micro"] for i in m) == sorted(list(range(37)) * 3)
    # the SimiGrad object the user holds has the fit's results, as after a fit in one process
    assert cb.history == ranks[0]["history"] and len(cb.history) > 0
    assert cb.samples_seen == 3 * 37 and cb.steps == len(cb.history)
    assert cb.batch_size is not None and cb.controller is not None
    assert cb.controller.measured_steps >= len(cb.history) - 3


class ValidatedBatchNorm(BatchNormNet):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.net(batch[1]).pow(2).mean())

    def val_dataloader(self):
        return DataLoader(RandomDataset(32, 16), batch_size=8)


def test_stochastic_weight_averagings_batchnorm_epoch_takes_no_optimizer_step():
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    def run(simigrad: bool):
        pl.seed_everything(0)
        model = ValidatedBatchNorm()
        swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2)
        steps, validations = StepsPerEpoch(), ValidationsPerEpoch()
        callbacks = [swa, steps, validations] + ([SimiGrad(target_similarity=0.9)] if simigrad else [])
        t = trainer(callbacks=callbacks, max_epochs=4)
        t.fit(model, DataLoader(RandomDataset(32, 64), batch_size=8, shuffle=True))
        return model, swa, steps.steps, validations.per_epoch

    _, _, plain_steps, plain_validations = run(simigrad=False)
    assert sorted(plain_steps) == [0, 1, 2, 3, 4]  # SWA adds a fifth epoch, for BatchNorm's statistics
    model, swa, steps, validations = run(simigrad=True)
    assert sorted(steps) == [0, 1, 2, 3]  # the fifth ran no backward: nothing to step
    assert validations == plain_validations == {epoch: 1 for epoch in range(5)}  # validated after it, too
    # the model holds the averaged weights SWA transferred, untouched ...
    for p, averaged in zip(model.parameters(), swa._average_model.parameters()):
        torch.testing.assert_close(p.detach(), averaged.detach(), rtol=0, atol=0)
    # ... and BatchNorm's statistics are the plain average over the epoch's micro-batches, at those weights
    bn = model.net[1]
    data = RandomDataset(32, 64).data
    last_epoch = model.micro_batches[-int(bn.num_batches_tracked) :]
    assert sorted(i for m in last_epoch for i in m) == list(range(64))
    with torch.no_grad():
        means = torch.stack([model.net[0](data[m]).mean(0) for m in last_epoch]).mean(0)
    torch.testing.assert_close(bn.running_mean, means)
