"""The one-process measurement through its protocol: the window's halves in time, against float64 references."""

from __future__ import annotations

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


# ------------------------------------------------------------------- the spare: the previous window's first half
class SignedZeros(torch.nn.Module):
    """A small network, and a parameter whose gradient is exact -0.0 (:meth:`loss` adds ``(idle * -0.0).sum()``),
    which a buffer filled with +0.0 would turn into +0.0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
        self.idle = torch.nn.Parameter(torch.ones(3))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mse = torch.nn.functional.mse_loss(self.net(x), y, reduction="sum") / 16
        return mse + (self.idle * torch.full((3,), -0.0)).sum()


def backward_windows(measurement, fresh: bool, windows: int = 4) -> list[tuple]:
    """Windows of real backward passes (autograd's in-place accumulation) through ``measurement``; each window's
    gradient and statistics, and where each gradient lived after the second half's first backward."""
    model = SignedZeros()
    params = list(model.parameters())
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(windows):
        if fresh:
            measurement.halves.aside.drop()  # no spare: the second half allocates, as without one
        for p in params:
            p.grad = None  # Lightning's zero_grad(set_to_none=True)
        w, fed, second_half = window(), [0, 0], None
        for j, n in enumerate(SIZES):
            measurement.start_micro_batch(w, j, params)
            x, y = torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)
            model.loss(x, y).backward()
            if j == w.half_split():
                second_half = [p.grad.data_ptr() for p in params]
            fed[j >= w.half_split()] += n
            measurement.after_backward(w, j, (fed[0], fed[1]), params)
        # the first half's buffers themselves: held here, so that memory freed by a dropped spare cannot come back
        # to a fresh gradient at the same address and pass for the spare
        first_half = [kept for _, kept in measurement.halves._joined]
        stats = measurement.collect(None)
        out.append(([p.grad.clone() for p in params], stats, second_half, first_half))
    return out


def test_the_spare_leaves_every_gradient_bitwise_as_fresh_buffers_leave_it():
    reused, fresh = backward_windows(window_halves(), fresh=False), backward_windows(window_halves(), fresh=True)
    for (grads, stats, _, _), (fresh_grads, fresh_stats, _, _) in zip(reused, fresh, strict=True):
        for grad, reference in zip(grads, fresh_grads, strict=True):
            assert torch.equal(grad, reference)
            assert torch.equal(grad.signbit(), reference.signbit())  # -0.0 stays -0.0
        assert stats == fresh_stats
    assert all(grads[0].signbit().all() and not grads[0].any() for grads, *_ in reused)  # `idle`'s: -0.0


def test_after_the_first_window_the_second_half_allocates_no_gradient():
    windows = backward_windows(window_halves(), fresh=False)
    for previous, current in zip(windows, windows[1:]):
        # the second half accumulated into the buffers the previous window's first half let go
        assert current[2] == [kept.data_ptr() for kept in previous[3]]
    fresh = backward_windows(window_halves(), fresh=True)
    assert not set(fresh[1][2]) & {kept.data_ptr() for kept in fresh[0][3]}  # without the spare, fresh buffers
