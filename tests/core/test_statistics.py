import math

import pytest
import torch

from lightning_simigrad import HalfStats, equilibrium_batch_size, expected_similarity


def test_hand_worked_values():
    # g_A = (1, 2), g_B = (3, 0), 2 and 6 samples
    s = HalfStats(dot=3.0, sq_a=5.0, sq_b=9.0, n_a=2, n_b=6)
    assert s.similarity == pytest.approx(3 / math.sqrt(45))
    assert s.grad_sq == 3.0
    # |g_A - g_B|^2 = 4 + 4 = 8, divided by 1/2 + 1/6
    assert s.trace_sigma == pytest.approx(8 / (2 / 3))
    assert s.batch_size == 8
    assert s.scaled(0.5).sq_b == pytest.approx(9 / 4)
    assert s.scaled(0.5).similarity == pytest.approx(s.similarity)


@pytest.mark.parametrize(
    "stats",
    [
        HalfStats(math.inf, 1.0, 1.0, 2, 2),
        HalfStats(math.nan, 1.0, 1.0, 2, 2),
        HalfStats(0.0, 0.0, 1.0, 2, 2),
        HalfStats(0.5, 1.0, 1.0, 0, 2),
    ],
)
def test_non_finite_or_empty_is_flagged(stats):
    assert not stats.is_finite


def test_equilibrium_inverts_expected_similarity():
    for noise_scale in (1.0, 37.0, 1e4):
        for tau in (0.2, 0.5, 0.8):
            b = equilibrium_batch_size(noise_scale, tau)
            assert expected_similarity(b, noise_scale) == pytest.approx(tau)
    assert equilibrium_batch_size(100, 0.8) == pytest.approx(800)


def test_estimators_are_unbiased_and_similarity_matches_theory():
    # per-sample gradients G + noise with known |G|^2 = 1 and tr(Sigma) = d * sigma^2 = 50: B_noise = 50
    torch.manual_seed(0)
    d, trials, n = 200, 400, 50
    sigma = math.sqrt(50 / d)
    G = torch.zeros(d, dtype=torch.float64)
    G[0] = 1.0
    samples = G + sigma * torch.randn(trials, 2 * n, d, dtype=torch.float64)
    g_a, g_b = samples[:, :n].mean(1), samples[:, n:].mean(1)
    stats = [HalfStats(float(a @ b), float(a @ a), float(b @ b), n, n) for a, b in zip(g_a, g_b)]
    grad_sq = sum(s.grad_sq for s in stats) / trials
    trace = sum(s.trace_sigma for s in stats) / trials
    similarity = sum(s.similarity for s in stats) / trials
    assert grad_sq == pytest.approx(1.0, abs=0.05)
    assert trace == pytest.approx(50.0, rel=0.03)
    assert similarity == pytest.approx(expected_similarity(2 * n, 50.0), abs=0.02)


@pytest.mark.parametrize("tau", [-1.0, 1.0, 1.5])
def test_target_out_of_range(tau):
    with pytest.raises(ValueError, match="target_similarity"):
        equilibrium_batch_size(10, tau)


@pytest.mark.parametrize("sq_a, sq_b", [(-1e-30, 4.0), (4.0, -1e-30), (0.0, 4.0), (math.nan, 4.0), (-1.0, -1.0)])
def test_similarity_of_non_positive_norms_is_nan_never_an_error(sq_a: float, sq_b: float) -> None:
    # rounding can leave a squared norm measured by difference a few ulps below zero (DDP at W >= 3)
    assert math.isnan(HalfStats(dot=1.0, sq_a=sq_a, sq_b=sq_b, n_a=2, n_b=2).similarity)
