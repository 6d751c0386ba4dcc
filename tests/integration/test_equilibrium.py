"""The batch size settles where theory puts it, on a problem whose noise scale is known exactly.

Each sample ``i`` carries a vector ``v_i = G + sigma * xi_i`` and its loss is ``w . v_i``, so its gradient is
``v_i`` whatever ``w`` is: a stationary problem with ``|G|^2 = 1`` and ``tr(Sigma) = d sigma^2``, hence a
simple noise scale ``B_noise = d sigma^2`` and, for a target similarity ``tau``, an equilibrium batch
``B* = 2 B_noise tau / (1 - tau)``.
"""

from __future__ import annotations

import statistics

import pytest
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad, equilibrium_batch_size
from tests.support.helpers import NOISE_SCALE, LinearLoss, known_noise_dataset, trainer


@pytest.mark.parametrize("controller", ["paper", "noise_scale"])
def test_batch_size_settles_at_the_equilibrium(controller):
    target = 0.8
    expected = equilibrium_batch_size(NOISE_SCALE, target)  # 200
    # max_steps counts optimizer steps here (not steps of B0 samples): 160 steps, whatever their size
    cb = SimiGrad(target_similarity=target, controller=controller, max_micro_batch_size=256, schedule_by_samples=False)
    t = trainer(callbacks=[cb], max_steps=160, max_epochs=-1)
    t.fit(LinearLoss(), DataLoader(known_noise_dataset(), batch_size=32, shuffle=True))
    sizes = [h["batch_size"] for h in cb.history]
    assert sizes[0] == 32
    settled = statistics.median(sizes[-60:])
    assert 0.8 * expected <= settled <= 1.25 * expected, (settled, expected)
    # the noise scale it measures on the way is the true one
    assert cb.history[-1]["noise_scale"] == pytest.approx(NOISE_SCALE, rel=0.2)
    similarity = statistics.mean(h["similarity"] for h in cb.history[-60:])
    assert similarity == pytest.approx(target, abs=0.05)
