"""At frozen weights, what SimiGrad logs is the noise scale and the similarity that exact per-sample gradients give.

A softmax regression (100 features, 10 classes, 2,048 samples labelled by a random softmax teacher) at two points of
its gradient descent: where the simple noise scale is a tenth of N and where it is half of N. The truth comes from
every sample's gradient (``torch.func``, float64, ``benchmarks/noise_scale_reference.py``); the logged values from
``SimiGrad(adjust=False)`` training at lr 0. The model's gradient noise spreads over many directions, so that each
step's |G|^2 estimate is informative at B = 32 too; at fixed weights the convergence of the smoothed ratio is then a
matter of memory: the default ``noise_scale_decay=0.9`` over 120 steps at B = 512, and 0.99 (100 steps) over 500
and 300 steps at B = 32 and 128, where a step's |G|^2 estimate is mostly noise (B_noise / (B/2) = 64 and 16 at N/2;
with the default decay the mean ran 12% high at B = 128 and N/2 in one run).
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("noise_scale_reference", REPO / "benchmarks" / "noise_scale_reference.py")
assert spec is not None and spec.loader is not None
reference = importlib.util.module_from_spec(spec)
sys.modules["noise_scale_reference"] = reference
spec.loader.exec_module(reference)

N, D, C = 2048, 100, 10


def teacher_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=gen)
    teacher = torch.randn(D, C, generator=gen) * 3 / D**0.5
    y = torch.multinomial(torch.softmax(x @ teacher, 1), 1, generator=gen)[:, 0]
    # a small shift of each class's mean: a larger gradient at the start, B_noise below N/10 there
    mu = torch.randn(C, D, generator=gen) * (4 / D) ** 0.5
    return x + mu[y], y


def noise_scale_of_softmax_regression(net: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> float:
    """B_noise in closed form: a sample's gradient is (p_i - e_y) [x_i, 1], so |g_i|^2 = |p_i - e_y|^2 (|x_i|^2 + 1)."""
    with torch.no_grad():
        xd = x.double()
        r = torch.softmax(xd @ net.weight.double().T + net.bias.double(), 1) - nn.functional.one_hot(y, C).double()
        G = torch.cat([(r.T @ xd).flatten(), r.sum(0)]) / len(x)
        grad_sq = float(G @ G)
        mean_sq = float((((xd**2).sum(1) + 1) * (r**2).sum(1)).mean())
    return (mean_sq - grad_sq) / grad_sq


def checkpoints(x: torch.Tensor, y: torch.Tensor) -> dict[float, dict[str, torch.Tensor]]:
    """The first full-batch gradient-descent iterates whose noise scale reaches N/10 and N/2."""
    net = nn.Linear(D, C)
    nn.init.zeros_(net.weight), nn.init.zeros_(net.bias)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    found: dict[float, dict[str, torch.Tensor]] = {}
    for _ in range(500):
        b_noise = noise_scale_of_softmax_regression(net, x, y)
        for share in (0.1, 0.5):
            if share not in found and b_noise >= share * N:
                found[share] = {k: v.clone() for k, v in net.state_dict().items()}
        if len(found) == 2:
            return found
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    raise AssertionError("gradient descent did not reach a noise scale of N/2")


@pytest.fixture(scope="module")
def frozen():
    torch.manual_seed(0)
    x, y = teacher_data()
    return x, y, checkpoints(x, y)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("share", [0.1, 0.5])
def test_the_logged_noise_scale_and_similarity_match_the_exact_ones_at_frozen_weights(frozen, share):
    x, y, saved = frozen
    net = nn.Linear(D, C)
    net.load_state_dict(saved[share])
    truth = reference.exact(net, x, y)
    # the per-sample gradients agree with the closed form, and the checkpoint is where it was meant to be
    assert truth.noise_scale == pytest.approx(noise_scale_of_softmax_regression(net, x, y), rel=1e-9)
    assert share * N <= truth.noise_scale <= 1.5 * share * N
    # smaller steps say less (B_noise / (B/2) = 64 at B = 32 and N/2): more of them, averaged over a longer memory
    for batch, steps, decay in ((32, 500, 0.99), (128, 300, 0.99), (512, 120, 0.9)):
        logged = reference.logged_at_frozen_weights(net, x, y, batch, steps=steps, noise_scale_decay=decay)
        assert all(stats.batch_size == batch for stats, _ in logged.raw)
        assert {population for _, population in logged.raw} == {N}  # the epoch's N reached the controller
        noise_scale, _, nan_share = reference.mean_and_error(logged.noise_scale)
        assert nan_share == 0
        assert noise_scale == pytest.approx(truth.noise_scale, rel=0.10), (batch, noise_scale, truth.noise_scale)
        expected, expected_error = truth.similarity(batch, draws=2000, seed=batch)
        similarities = logged.similarity[reference.WARMUP :]
        error = statistics.stdev(similarities) / math.sqrt(len(similarities))
        assert abs(statistics.mean(similarities) - expected) <= 4 * math.hypot(error, expected_error), batch
