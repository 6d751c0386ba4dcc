"""Mixed precision: the halves are compared in the same (unscaled) units, and overflowed steps are not acted on."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from lightning_simigrad import BatchSizeController, HalfStats, SimiGrad
from tests.support.helpers import IndexedRegression, Regressor, trainer


class FiniteProbe(pl.Callback):
    def __init__(self):
        self.finite: list[bool] = []
        self.scales: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.finite.append(all(torch.isfinite(p.grad).all() for p in pl_module.parameters()))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(float(scaler.get_scale()) if scaler is not None else 1.0)


class Overflowing(Regressor):
    """Blows the loss up on a few micro-batches, as an fp16 overflow would."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 1e30 if batch_idx in (3, 9) else loss


def fp16_with_loss_scaling() -> MixedPrecision:
    # Lightning maps "16-mixed" to bf16 on CPU; this builds the GPU recipe (fp16 autocast + GradScaler) on CPU
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_measures_in_unscaled_units(precision, step_audit):
    kwargs = dict(plugins=[fp16_with_loss_scaling()]) if precision == "16-mixed" else dict(precision=precision)
    pl.seed_everything(0)
    dataset = IndexedRegression(256, dtype=torch.float32)
    cb, recorder = SimiGrad(target_similarity=0.8, adjust=False), step_audit(dataset)
    t = trainer(callbacks=[cb, recorder], max_epochs=2, **kwargs)
    t.fit(Regressor(dtype=torch.float32), DataLoader(dataset, batch_size=16))
    # the same statistics from full-precision gradients of the same halves, fed to a fresh controller
    reference = BatchSizeController(target_similarity=0.8, initial_batch_size=16)
    for step, row in zip(recorder.steps, cb.history):
        if not math.isfinite(row["similarity"]):
            continue  # an overflowed step the scaler skipped
        dot, sq_a, sq_b = step.halves_products
        stats = HalfStats(dot, sq_a, sq_b, len(step.halves[0]), len(step.halves[1]))
        assert row["similarity"] == pytest.approx(stats.similarity, abs=0.02)
        reference.update(stats, adjust=False, population=len(dataset))  # the epoch's N, as the run passes it
    assert reference.measured_steps >= t.global_step - 2
    # B_noise = tr(Sigma) / |G|^2 is not scale-free: a half left scaled by the GradScaler's 2^15 would put it
    # orders of magnitude off
    assert cb.controller.noise_scale == pytest.approx(reference.noise_scale, rel=0.1)


def test_overflowed_steps_are_skipped_by_the_controller():
    cb, probe = SimiGrad(target_similarity=0.8), FiniteProbe()
    t = trainer(callbacks=[cb, probe], plugins=[fp16_with_loss_scaling()])
    t.fit(Overflowing(dtype=torch.float32), DataLoader(IndexedRegression(256, dtype=torch.float32), batch_size=16))
    assert probe.finite.count(False) >= 2
    finite_measured = sum(f and h["accumulation"] >= 2 for f, h in zip(probe.finite, cb.history))
    assert cb.controller.measured_steps == finite_measured
    # the steps the GradScaler skipped were not acted on: their similarity is logged as non-finite
    for f, h in zip(probe.finite, cb.history):
        if not f:
            assert not math.isfinite(h["similarity"])
    assert probe.scales[0] > probe.scales[-1]  # the scaler did back off
