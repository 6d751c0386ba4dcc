"""The one-process measurement through its protocol: the window's halves in time, against float64 references."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from lightning_simigrad import Window
from lightning_simigrad.measurement import Measurement, window_halves

SIZES = (3, 5, 4, 4)  # micro-batches of one window: halves of 8 samples each (split after the second)


def window() -> Window:
    return Window(tuple((n,) for n in SIZES))


def params_and_grads(seed: int = 0) -> tuple[list[torch.nn.Parameter], list[list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in [(7, 3), (3,), (11,)]]
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in SIZES]
    return params, grads


def accumulate(params, grads, measurement, stop=4, skip=()):
    """Run the window's micro-batches through the measurement, as the run does, accumulating as autograd does."""
    fed = [0, 0]
    w = window()
    for j in range(stop):
        measurement.start_micro_batch(w, j, params)
        if j in skip:
            continue
        for p, grad in zip(params, grads[j]):
            p.grad = grad.clone() if p.grad is None else p.grad + grad
        fed[j >= w.half_split()] += SIZES[j]
        measurement.after_backward(w, j, (fed[0], fed[1]), params)


def halves_joined(grads) -> list[torch.Tensor]:
    """The window's gradient as the measurement leaves it: the first half's sum added to the second half's."""
    return [sum(g[i] for g in grads[:2]) + sum(g[i] for g in grads[2:]) for i in range(3)]


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in tensors])


def test_collect_gives_the_halves_statistics_and_leaves_the_whole_gradient():
    measurement = window_halves()
    assert isinstance(measurement, Measurement)
    params, grads = params_and_grads()
    accumulate(params, grads, measurement)
    stats = measurement.collect(loss_scale=None)
    s = flat([sum(g[i] for g in grads[:2]) for i in range(3)])  # sums over the halves, as accumulated
    r = flat([sum(g[i] for g in grads[2:]) for i in range(3)])
    g_a, g_b = s * 16 / 8, r * 16 / 8  # each half's mean: N / n_A times its share (every sample weighs 1/N)
    assert stats.dot == pytest.approx(float(g_a @ g_b), rel=1e-6)
    assert (stats.sq_a, stats.sq_b) == (pytest.approx(float(g_a @ g_a), rel=1e-6), pytest.approx(float(g_b @ g_b)))
    assert (stats.n_a, stats.n_b) == (8, 8)
    assert torch.equal(flat([p.grad for p in params]), flat(halves_joined(grads)))


def test_a_loss_scale_is_taken_out_whether_a_tensor_or_a_float():
    params, grads = params_and_grads()
    reference = window_halves()
    accumulate(params, grads, reference)
    unscaled = reference.collect(None)
    for scale in (1024.0, torch.tensor(1024.0)):
        params, grads = params_and_grads()
        measurement = window_halves()
        accumulate(params, [[g * 1024 for g in micro] for micro in grads], measurement)
        stats = measurement.collect(scale)
        assert stats.dot == pytest.approx(unscaled.dot, rel=1e-6)
        assert stats.sq_a == pytest.approx(unscaled.sq_a, rel=1e-6)


def test_a_skipped_last_micro_batch_is_not_measured_and_the_gradient_stays_whole():
    measurement = window_halves()
    params, grads = params_and_grads()
    accumulate(params, grads, measurement, skip={3})
    assert measurement.collect(None) is None
    assert torch.equal(flat([p.grad for p in params]), flat([sum(g[i] for g in grads[:3]) for i in range(3)]))


def test_an_aborted_window_gives_its_first_half_back_and_nothing_reaches_the_next_window():
    measurement = window_halves()
    params, grads = params_and_grads()
    accumulate(params, grads, measurement, stop=3)  # abandoned after its midpoint
    assert measurement.halves.holds_first_half
    measurement.abort()
    assert not measurement.halves.holds_first_half
    assert torch.equal(flat([p.grad for p in params]), flat([sum(g[i] for g in grads[:3]) for i in range(3)]))
    for p in params:  # the next window's zero_grad
        p.grad = None
    next_params, next_grads = params, params_and_grads(seed=1)[1]
    accumulate(next_params, next_grads, measurement)
    assert measurement.collect(None) is not None
    assert torch.equal(flat([p.grad for p in params]), flat(halves_joined(next_grads)))


# ------------------------------------------------------------- memory: what the halves hold, and for how long
def test_the_second_half_keeps_its_first_backwards_tensor_and_the_first_half_is_freed_once_read():
    """Real backward passes (autograd's own accumulation): the measurement allocates nothing gradient-sized of its
    own, and holds one more gradient than plain accumulation only from the midpoint until the products are read."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    params = list(model.parameters())
    measurement = window_halves()
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p in params:
            p.grad = None  # Lightning's zero_grad(set_to_none=True)
        w, fed, first_half, second_half = window(), [0, 0], [], []
        for j, n in enumerate(SIZES):
            measurement.start_micro_batch(w, j, params)
            if j == w.half_split():
                assert all(p.grad is None for p in params)  # the first half moved aside, not copied
            x, y = torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)
            torch.nn.functional.mse_loss(model(x), y, reduction="sum").div(16).backward()
            if j == w.half_split() - 1:
                first_half = [weakref.ref(p.grad) for p in params]
            if j == w.half_split():
                second_half = [p.grad for p in params]
            fed[j >= w.half_split()] += n
            measurement.after_backward(w, j, (fed[0], fed[1]), params)
        assert measurement.collect(None) is not None
        # the window's gradient lives in the tensors the second half's first backward made, as plain keeps the first
        assert all(p.grad is kept for p, kept in zip(params, second_half, strict=True))
        del second_half
        gc.collect()
        assert all(ref() is None for ref in first_half)  # read and added back: nothing held into the next window
