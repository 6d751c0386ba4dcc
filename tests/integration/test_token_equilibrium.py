"""Batches counted in tokens settle where theory puts them, on a problem whose per-token noise is known exactly.

Token ``t`` of sequence ``i`` carries ``v_t = G + sigma xi_t + sigma_s eta_i`` (tests/support/token_noise.py), the
loss is the mean over the step's tokens of ``w . v_t``, so the step's gradient is the mean of its tokens' vectors.
The noise of a step of whole sequences holding ``T`` tokens is ``B_tok |G|^2 / T`` with the effective per-token
noise scale ``B_tok = d (sigma^2 + sigma_s^2 E[n^2] / E[n])``, and the paper controller holds the halves'
similarity at ``tau``, hence the batch at ``B* = 2 B_tok tau / (1 - tau)`` tokens.

The logged noise scale counts samples (sequences) of the token-weighted gradient; ``noise_scale_tokens``, the same
times the step's tokens per sample (``batch_size / batch_samples``), reads ``B_tok``.

Seeds 0-9 (the test runs seed 0), at either cap (the same steps, halves and figures at both), settled / B*:
independent tokens 0.89-1.00, correlated tokens 0.91-1.01; the noise scale in tokens / B_tok: 0.97-1.03 and
0.96-1.04; mean similarity 0.785-0.799.
"""

from __future__ import annotations

import statistics

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad, equilibrium_batch_size
from tests.support.helpers import trainer
from tests.support.token_noise import (
    StepTokens,
    TokenLinearLoss,
    TokenNoise,
    pad_tokens,
    token_count,
    token_noise_scale,
)

TARGET = 0.8
DIM, SIGMA, MAX_LENGTH = 64, 1.25, 40  # d sigma^2 = 100 per token: B* = 800 tokens (~39 sequences of ~20.5)
STEPS = 160
SETTLED = STEPS // 2  # the last half of the run: the batch reaches B* from 400 tokens within ~20 steps


def settle(shared: float, cap: int, seed: int = 0) -> dict:
    """The settled batch (tokens), the mean noise scale in tokens and similarity, and the step audit of a run."""
    dataset = TokenNoise(4000, DIM, SIGMA, shared, max_length=MAX_LENGTH, seed=seed)
    lengths = dataset.lengths.tolist()
    pl.seed_everything(seed, verbose=False)
    cb = SimiGrad(
        TARGET,
        lengths=lengths,
        max_micro_batch_tokens=cap,
        loss_items=token_count,
        initial_batch_size=400,
        schedule_by_samples=False,
    )
    steps = StepTokens(cb)
    t = trainer(callbacks=[cb, steps], max_steps=STEPS, max_epochs=-1)
    t.fit(TokenLinearLoss(DIM), DataLoader(dataset, batch_size=8, shuffle=True, collate_fn=pad_tokens))
    rows = cb.history[-SETTLED:]
    return {
        "history": cb.history,
        "steps": steps.steps,
        "lengths": lengths,
        "settled": statistics.median(h["batch_size"] for h in rows),
        "noise_tokens": statistics.mean(h["noise_scale_tokens"] for h in rows),
        "similarity": statistics.mean(h["similarity"] for h in rows),
    }


def assert_steps_are_whole_sequences(run: dict) -> None:
    history, steps, lengths = run["history"], run["steps"], run["lengths"]
    assert len(steps) == len(history) == STEPS
    assert [h["batch_size"] for h in history] == [sum(lengths[i] for i in step) for step in steps]
    assert [h["batch_samples"] for h in history] == [len(step) for step in steps]


@pytest.mark.parametrize("cap", [4096, 320], ids=["one-run-window", "several-micro-batches"])
def test_independent_tokens_settle_at_the_token_equilibrium(cap):
    b_tok = token_noise_scale(DIM, SIGMA, 0.0, MAX_LENGTH)  # d sigma^2 = 100
    expected = equilibrium_batch_size(b_tok, TARGET)  # 800 tokens
    run = settle(shared=0.0, cap=cap)
    assert_steps_are_whole_sequences(run)
    if cap < expected:  # the window is several micro-batches
        assert max(h["accumulation"] for h in run["history"][-SETTLED:]) > 2
    assert 0.85 * expected <= run["settled"] <= 1.15 * expected, (run["settled"], expected)
    assert run["noise_tokens"] == pytest.approx(b_tok, rel=0.2)
    assert run["similarity"] == pytest.approx(TARGET, abs=0.03)


def test_correlated_tokens_settle_at_the_effective_token_equilibrium():
    shared = 0.25  # B_tok = 64 (1.5625 + 0.0625 * 27) = 208
    b_tok = token_noise_scale(DIM, SIGMA, shared, MAX_LENGTH)
    expected = equilibrium_batch_size(b_tok, TARGET)  # 1664 tokens
    per_token = DIM * (SIGMA**2 + shared**2)  # 104: each token's own variance, the scale if tokens were independent
    naive = equilibrium_batch_size(per_token, TARGET)  # 832 tokens
    run = settle(shared=shared, cap=320)
    assert_steps_are_whole_sequences(run)
    assert 0.85 * expected <= run["settled"] <= 1.15 * expected, (run["settled"], expected)
    assert run["settled"] > 1.3 * naive, (run["settled"], naive)
    assert run["noise_tokens"] == pytest.approx(b_tok, rel=0.2)
    assert run["noise_tokens"] > 1.3 * per_token
    assert run["similarity"] == pytest.approx(TARGET, abs=0.03)
