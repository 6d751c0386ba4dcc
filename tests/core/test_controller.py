import math

import pytest
import torch

from lightning_simigrad import BatchSizeController, HalfStats, equilibrium_batch_size


def stats(similarity: float, n: int = 50, noise_scale: float | None = None) -> HalfStats:
    """Halves of unit norm with the given cosine; optionally with |G|^2 and tr(Sigma) for a noise scale."""
    if noise_scale is None:
        return HalfStats(dot=similarity, sq_a=1.0, sq_b=1.0, n_a=n, n_b=n)
    # choose |G|^2 = 1 and tr(Sigma) = noise_scale: |g_A - g_B|^2 = tr(Sigma) * 2 / n, |g|^2 = 1 + tr / n
    sq = 1.0 + noise_scale / n
    return HalfStats(dot=1.0, sq_a=sq, sq_b=sq, n_a=n, n_b=n)


def test_paper_rule_grows_and_shrinks_by_its_factors():
    c = BatchSizeController(0.8, initial_batch_size=100)
    assert c.update(stats(0.5)) == 110
    assert c.update(stats(0.5)) == 121
    assert c.update(stats(0.95)) == round(121 * 0.9)
    assert c.similarity == pytest.approx(0.95)


def test_small_sizes_still_move():
    # 2 * 1.1 = 2.2 rounds back to 2; the real-valued state keeps growing until it shows
    c = BatchSizeController(0.8, initial_batch_size=2)
    sizes = [c.update(stats(0.0)) for _ in range(10)]
    assert sizes[-1] == round(2 * 1.1**10)


def test_bounds_clamp_both_ways():
    c = BatchSizeController(0.8, initial_batch_size=100, min_batch_size=90, max_batch_size=115)
    assert [c.update(stats(0.0)) for _ in range(3)] == [110, 115, 115]
    assert [c.update(stats(0.99)) for _ in range(4)] == [104, 93, 90, 90]
    assert BatchSizeController(0.8, initial_batch_size=10, min_batch_size=64).batch_size == 64


def test_deadband_and_warmup_hold_still():
    c = BatchSizeController(0.8, initial_batch_size=100, deadband=0.05, warmup_steps=2)
    assert c.update(stats(0.0)) == 100  # warm-up
    assert c.update(stats(0.0)) == 100  # warm-up
    assert c.update(stats(0.77)) == 100  # inside the deadband
    assert c.update(stats(0.70)) == 110


def test_adjust_false_measures_but_holds():
    c = BatchSizeController(0.8, initial_batch_size=100)
    assert c.update(stats(0.1), adjust=False) == 100
    assert c.measured_steps == 1
    assert c.similarity == pytest.approx(0.1)


def test_non_finite_measurements_are_ignored():
    c = BatchSizeController(0.8, initial_batch_size=100)
    assert c.update(HalfStats(math.inf, 1.0, 1.0, 50, 50)) == 100
    assert c.update(HalfStats(math.nan, math.nan, 1.0, 50, 50)) == 100
    assert c.measured_steps == 0
    assert math.isnan(c.similarity)


def test_smoothing_averages_the_similarity():
    c = BatchSizeController(0.8, initial_batch_size=100, smoothing=0.5)
    c.update(stats(0.4))
    assert c.similarity == pytest.approx(0.4)  # bias-corrected: the first value is itself
    c.update(stats(1.0))
    # EMA (0.5 * 0.4 * 0.5 + 0.5 * 1.0) / (1 - 0.25)
    assert c.similarity == pytest.approx((0.1 + 0.5) / 0.75)


def test_noise_scale_rule_jumps_to_equilibrium():
    c = BatchSizeController(0.8, initial_batch_size=64, rule="noise_scale")
    # one step shows no spread to judge its |G|^2 by: the rule steps as the paper's (cos 1/7 < 0.8: grow)
    assert c.update(stats(0.0, noise_scale=300.0)) == round(64 * 1.1) and not c.noise_scale_resolved
    assert c.update(stats(0.0, noise_scale=300.0)) == round(equilibrium_batch_size(300.0, 0.8))
    assert c.noise_scale == pytest.approx(300.0)
    # numerator and denominator are smoothed separately, each step's in units of the step before's |g_half|^2 (m;
    # the first step's own), then divided
    c.update(stats(0.0, noise_scale=100.0))
    weights = (0.081, 0.09, 0.1)  # the EMA's; every step is in units of the same m (1 + 300 / 50), which cancels
    assert c.noise_scale == pytest.approx((weights[0] * 300 + weights[1] * 300 + weights[2] * 100) / sum(weights))


def scaled_stats(noise_scale: float, grad_sq: float, n: int = 50) -> HalfStats:
    """Noiseless halves with |G|^2 = ``grad_sq`` and tr(Sigma) = ``noise_scale * grad_sq``."""
    return stats(0.0, n, noise_scale).scaled(grad_sq**0.5)


def test_noise_scale_follows_a_change_while_the_gradient_shrinks():
    # Training shrinks |G|^2 and tr(Sigma) by orders of magnitude while their ratio grows. An EMA of the raw
    # values is then ruled by steps long gone (on the digits recipe it read 125 where the last steps said
    # ~2,000); the smoothing must forget the past at its decay rate, whatever the past's magnitude.
    c = BatchSizeController(0.8, initial_batch_size=64, rule="noise_scale", noise_scale_decay=0.9)
    for _ in range(50):
        c.update(scaled_stats(noise_scale=25.0, grad_sq=1.0))
    assert c.noise_scale == pytest.approx(25.0)
    for _ in range(50):  # 0.9**50: 0.5% weight left on the old steps
        c.update(scaled_stats(noise_scale=400.0, grad_sq=1e-4))
    assert c.noise_scale == pytest.approx(400.0, rel=0.1)
    assert c.batch_size == pytest.approx(equilibrium_batch_size(400.0, 0.8), rel=0.1)


def test_noise_scale_does_not_depend_on_the_gradients_units():
    a = BatchSizeController(0.8, initial_batch_size=64, rule="noise_scale")
    b = BatchSizeController(0.8, initial_batch_size=64, rule="noise_scale")
    for ns, sq in ((10.0, 3.0), (40.0, 0.2), (25.0, 0.01)):
        a.update(scaled_stats(ns, sq))
        b.update(scaled_stats(ns, sq * 1e6))  # e.g. a loss scaled by 1000
    assert a.noise_scale == pytest.approx(b.noise_scale) and a.batch_size == b.batch_size


def test_state_dict_round_trip_continues_identically():
    a = BatchSizeController(0.5, initial_batch_size=100, smoothing=0.7, rule="paper")
    for s in (0.1, 0.9, 0.3):
        a.update(stats(s))
    b = BatchSizeController(0.5, initial_batch_size=7, smoothing=0.7)
    b.load_state_dict(a.state_dict())
    assert b.batch_size == a.batch_size
    for s in (0.2, 0.8):
        assert a.update(stats(s)) == b.update(stats(s))
    assert a.similarity == b.similarity and a.noise_scale == b.noise_scale


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(target_similarity=1.0), "target_similarity"),
        (dict(target_similarity=-1.2), "target_similarity"),
        (dict(target_similarity="0.8"), "target_similarity"),
        (dict(min_batch_size=0), "min_batch_size"),
        (dict(max_batch_size=-4), "max_batch_size"),
        (dict(min_batch_size=128, max_batch_size=64), "min_batch_size"),
        (dict(rule="adaptive"), "controller"),
        (dict(grow_factor=0.9), "grow_factor"),
        (dict(shrink_factor=1.1), "shrink_factor"),
        (dict(smoothing=1.0), "smoothing"),
        (dict(deadband=-0.1), "deadband"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(initial_batch_size=0), "initial_batch_size"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, name):
    args = dict(target_similarity=0.8, initial_batch_size=64) | kwargs
    with pytest.raises(ValueError, match=f"`{name}`") as info:
        BatchSizeController(**args)
    assert str(list(kwargs.values())[-1]) in str(info.value)  # the message shows the bad value


def finite_stats(population: int, trace: float, grad_sq: float = 1.0, n: int = 50) -> HalfStats:
    """Noiseless halves of a finite epoch: E[g_A . g_B] = |G|^2 - tr/(N - 1), E|g_A - g_B|^2 = tr N/(N - 1) (2/n)."""
    dot = grad_sq - trace / (population - 1)
    diff_sq = trace * population / (population - 1) * 2 / n
    sq = (diff_sq + 2 * dot) / 2
    return HalfStats(dot=dot, sq_a=sq, sq_b=sq, n_a=n, n_b=n)


def test_the_finite_population_is_estimated_and_aimed_at():
    population = 1000
    c = BatchSizeController(0.5, initial_batch_size=64, rule="noise_scale")
    for _ in range(2):  # the second step shows the first's estimate was not noise
        c.update(finite_stats(population, trace=300.0), population=population)
    assert c.noise_scale == pytest.approx(300.0)
    assert c.batch_size == round(equilibrium_batch_size(300.0, 0.5, population))  # 2 * 300 * 1000 / 699 = 858
    # the same numbers read as draws with replacement overstate the noise scale by N/(N-1) / (1 - 300/(N-1))
    c = BatchSizeController(0.5, initial_batch_size=64, rule="noise_scale")
    c.update(finite_stats(population, trace=300.0))
    assert c.noise_scale == pytest.approx(300.0 * 1000 / 999 / (1 - 300 / 999), rel=0.05)


def test_noise_beyond_the_epoch_grows_the_batch():
    # B_noise >= N - 1: no batch of the epoch reaches the target, the rule grows by its factor
    c = BatchSizeController(0.5, initial_batch_size=64, rule="noise_scale")
    assert c.update(finite_stats(100, trace=150.0), population=100) == round(64 * 1.1)
    assert c.noise_scale == pytest.approx(150.0)


def test_the_smoothing_converges_to_the_truth_at_fixed_weights_for_every_batch_size():
    # random halves of a finite population with a known noise scale; the mean logged value over many steps must
    # be the noise scale whatever B. Dividing each step's estimates by its own |g_half|^2 (the former smoothing)
    # weighs a step by a function of its own noise: a ratio of noisy estimates, biased by B.
    gen = torch.Generator().manual_seed(0)
    population, dim = 2000, 400
    g = torch.randn(population, dim, generator=gen, dtype=torch.float64) * 3.0 + 0.3
    G = g.mean(0)
    truth = float(((g - G) ** 2).sum(1).mean() / (G @ G))  # 225 / 36: 250
    for batch in (32, 512):
        c = BatchSizeController(0.5, initial_batch_size=batch, noise_scale_decay=0.9)
        logged = []
        for step in range(600):
            perm = torch.randperm(population, generator=gen)[:batch]
            a, b = g[perm[: batch // 2]].mean(0), g[perm[batch // 2 :]].mean(0)
            c.update(HalfStats(float(a @ b), float(a @ a), float(b @ b), batch // 2, batch // 2), False, population)
            if step >= 20:
                logged.append(c.noise_scale)
        assert sum(logged) / len(logged) == pytest.approx(truth, rel=0.05), batch


def finite_population(size: int, noise_scale: float, noisy_directions: int, seed: int) -> torch.Tensor:
    """Per-sample gradients of a finite epoch with a known noise scale, the noise spread over few directions
    (as on the digits recipe, where a step's |G|^2 estimate at a small batch is mostly noise)."""
    gen = torch.Generator().manual_seed(seed)
    dim = 32
    spread = torch.full((dim,), 0.05, dtype=torch.float64)
    spread[1 : 1 + noisy_directions] = 1.0
    noise = torch.randn(size, dim, generator=gen, dtype=torch.float64) * spread
    noise -= noise.mean(0)
    noise *= (noise_scale / (noise**2).sum(1).mean()) ** 0.5  # |G|^2 = 1: tr(Sigma) = noise_scale
    return noise + torch.nn.functional.one_hot(torch.tensor(0), dim).to(torch.float64)


def follow(c: BatchSizeController, g: torch.Tensor, steps: int, seed: int) -> list[int]:
    """The controller's batch sizes over ``steps`` windows drawn from epochs of ``g`` without replacement."""
    gen = torch.Generator().manual_seed(seed)
    population, order, at, sizes = len(g), torch.randperm(len(g), generator=gen), 0, []
    for _ in range(steps):
        batch = min(c.batch_size, population)
        if at + batch > population:
            order, at = torch.randperm(population, generator=gen), 0
        window, at = order[at : at + batch], at + batch
        a, b = g[window[: batch // 2]].mean(0), g[window[batch // 2 :]].mean(0)
        c.update(HalfStats(float(a @ b), float(a @ a), float(b @ b), batch // 2, batch - batch // 2), True, population)
        sizes.append(batch)
    return sizes


def test_the_noise_scale_rule_does_not_jump_on_an_estimate_it_cannot_tell_from_noise():
    # B* = 17 at B_noise = 20, tau = 0.3, N = 1437 (the digits recipe's epoch). At B ~ 17 a step's |G|^2 estimate
    # is mostly noise: its average crossed zero, B_noise read as 1,000-1,600 (near N, where B* diverges) and the
    # rule jumped to the cap, x57 in one step, in 9 runs of 20; on digits that jump (with the LR scaled to match)
    # threw the run off course and held the batch at 16 for ~60 steps. Until the averaged |G|^2 stands 3 standard
    # errors above zero the rule steps as the paper's.
    population, tau = 1437, 0.3
    b_star = equilibrium_batch_size(20.0, tau, population)
    assert 17 < b_star < 18
    runs = []
    for seed in range(20):
        g = finite_population(population, 20.0, noisy_directions=2, seed=seed)
        c = BatchSizeController(tau, initial_batch_size=16, min_batch_size=16, max_batch_size=1024, rule="noise_scale")
        runs.append(follow(c, g, steps=300, seed=seed))
    biggest_jump = max(max(b / a for a, b in zip(sizes, sizes[1:])) for sizes in runs)
    largest = max(max(sizes) for sizes in runs)
    assert biggest_jump < 3 and largest < 4 * b_star, (biggest_jump, largest)
    settled = sorted(size for sizes in runs for size in sizes[100:])
    assert 0.8 * b_star < settled[len(settled) // 2] < 1.5 * b_star  # and it still settles near B*


def test_the_spread_of_the_noise_scale_estimate_survives_a_checkpoint():
    g = finite_population(1437, 20.0, noisy_directions=2, seed=0)
    a = BatchSizeController(0.3, initial_batch_size=16, min_batch_size=16, rule="noise_scale")
    follow(a, g, steps=40, seed=0)
    state, saved = a.state_dict(), a.noise_scale
    b = BatchSizeController(0.3, initial_batch_size=16, min_batch_size=16, rule="noise_scale")
    b.load_state_dict(state)
    assert follow(a, g, steps=60, seed=1) == follow(b, g, steps=60, seed=1)
    # a checkpoint written before the spread was kept resumes with the spread afresh: not resolved until it is
    older = {k: v for k, v in state.items() if k != "referenced_grad_sq_square_ema"}
    assert "referenced_grad_sq_square_ema" not in BatchSizeController.state_fields(older)
    c = BatchSizeController(0.3, initial_batch_size=16, min_batch_size=16, rule="noise_scale")
    c.load_state_dict(older)
    assert c.noise_scale == saved and not c.noise_scale_resolved


def test_the_ratchet_grows_towards_b_star_by_at_most_its_factor_and_never_shrinks():
    c = BatchSizeController(0.8, initial_batch_size=100, rule="ratchet")
    b_star = equilibrium_batch_size(100.0, 0.8)  # 800
    sizes = [c.update(stats(0.0, noise_scale=100.0)) for _ in range(30)]
    # the first step cannot judge its |G|^2 (cos 1/3 < 0.8: grow); then x1.1 a step until B*, and there it stays
    expected, size = [], 100.0
    for _ in range(30):
        size = min(size * 1.1, b_star)
        expected.append(round(size))
    assert sizes == expected and sizes[-1] == round(b_star)
    # the noise falls (B* = 80): the paper rule and the noise-scale rule would shrink, the ratchet holds
    assert [c.update(stats(0.9, noise_scale=10.0)) for _ in range(5)] == [round(b_star)] * 5
    # a larger B* later: growth resumes, still at most x1.1 a step
    assert c.update(stats(0.0, noise_scale=1000.0)) == round(b_star * 1.1)


def test_the_ratchet_before_the_noise_scale_is_resolved_grows_below_the_target_and_otherwise_holds():
    c = BatchSizeController(0.5, initial_batch_size=100, rule="ratchet", noise_scale_decay=0.9)
    assert c.update(stats(0.2)) == 110 and not c.noise_scale_resolved  # one step gives no spread: below, grow
    # halves of unit norm and cosine 0.9: |G|^2 0.9, no spread, B_noise = 2 n (1 - 0.9) / (2 * 0.9) ~ 5.6, B* ~ 11
    assert [c.update(stats(0.9)) for _ in range(3)] == [110] * 3


def test_a_batch_in_tokens_aims_at_b_star_in_tokens():
    # the halves hold 50 samples each, of a step that asked for 6,400 tokens: 64 tokens a sample
    c = BatchSizeController(0.8, initial_batch_size=6400, rule="noise_scale", counts_tokens=True)
    assert c.update(stats(0.0, noise_scale=100.0)) == 7040  # unresolved: the paper rule's step
    # B* = 800 samples, at the 7,040 / 100 tokens a sample the step asked for
    assert c.update(stats(0.0, noise_scale=100.0)) == round(800 * 7040 / 100)
    samples = BatchSizeController(0.8, initial_batch_size=6400, rule="noise_scale")
    samples.update(stats(0.0, noise_scale=100.0))
    assert samples.update(stats(0.0, noise_scale=100.0)) == 800  # in samples B* is the batch itself
    ratchet = BatchSizeController(0.8, initial_batch_size=6400, rule="ratchet", counts_tokens=True)
    assert [ratchet.update(stats(0.0, noise_scale=100.0)) for _ in range(2)] == [7040, 7744]  # x1.1: B* far above


def test_settings_carry_the_unit_to_the_controller_and_accept_every_rule_in_tokens():
    from lightning_simigrad.core.settings import Settings

    for rule in ("paper", "noise_scale", "ratchet"):
        settings = Settings(0.5, lengths=[3, 4], initial_batch_size=64, controller=rule)
        assert settings.controller_args(64)["counts_tokens"] is True
    assert Settings(0.5, controller="ratchet").controller_args(64)["counts_tokens"] is False


def test_a_controller_without_a_target_measures_but_refuses_to_move_the_batch() -> None:
    c = BatchSizeController(target_similarity=None, initial_batch_size=100)
    stats = HalfStats(dot=0.1, sq_a=1.0, sq_b=1.0, n_a=50, n_b=50)
    assert c.update(stats, adjust=False) == 100 and c.measured_steps == 1
    assert c.similarity == pytest.approx(0.1)
    before = c.state_dict()
    with pytest.raises(ValueError, match="without `target_similarity`.*adjust=False"):
        c.update(stats)
    assert c.measured_steps == 1 and c.state_dict() == before  # the refused step left nothing behind
