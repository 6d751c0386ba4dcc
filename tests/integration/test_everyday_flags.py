"""The Trainer flags users set every day (their own accumulation, ``overfit_batches``, reloading loaders, determinism,
gradient clipping), with SimiGrad added: every step still the mean over exactly its samples.
"""

from __future__ import annotations

import pytest

from lightning_simigrad import SimiGrad
from tests.support.lightning_features import fit_boring


@pytest.mark.parametrize(
    "flags,per_epoch,first_step",
    [
        (dict(accumulate_grad_batches=3), 128, 24),  # B0 = 8 x 3: the user's accumulation sets the first batch
        (dict(overfit_batches=2), 16, 8),  # the same first 2 batches of samples every epoch, in order
        (dict(reload_dataloaders_every_n_epochs=1), 128, 8),
        (dict(deterministic=True, gradient_clip_val=0.5, log_every_n_steps=1), 128, 8),
    ],
)
def test_everyday_trainer_flags_keep_every_step_exact(flags, per_epoch, first_step):
    cb = SimiGrad(target_similarity=0.95)
    t, model, audit = fit_boring(cb, max_epochs=3, **flags)
    seen = [i for s in audit.samples for i in s]
    assert cb.samples_seen == len(seen) == 3 * per_epoch
    for epoch in range(3):
        assert len(set(seen[epoch * per_epoch : (epoch + 1) * per_epoch])) == per_epoch
    if "overfit_batches" in flags:
        assert sorted(set(seen)) == list(range(16))
    assert cb.history[0]["batch_size"] == first_step
    assert max(audit.errors) < 1e-5  # (before clipping, which Lightning applies after on_before_optimizer_step)
