"""The learning-rate factor applied around `optimizer.step` only: the scheduler sees its own values, bit for bit."""

from __future__ import annotations

import math

import torch

from lightning_simigrad.integration.lr_scaler import StepLRScaler


def optimizer_and_scheduler():
    param = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    return param, optimizer, scheduler


def test_each_step_applies_the_factor_and_the_scheduler_keeps_its_own_values():
    param, optimizer, scheduler = optimizer_and_scheduler()
    scaler = StepLRScaler()
    scaler.attach(optimizer)
    for step, factor in enumerate([2.0, 0.5, 3.0]):
        scaler.factor = factor
        before = float(param)
        param.grad = torch.ones(1, dtype=torch.float64)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        assert float(param) == before - lr * factor  # the step moved by the scaled learning rate
        assert optimizer.param_groups[0]["lr"] == lr  # and left the scheduler's value as it was
        assert scaler.applied_lr() == lr * factor
        scheduler.step()
        assert optimizer.param_groups[0]["lr"] == 0.1 / (step + 2)
    scaler.detach()
    param.grad = torch.ones(1, dtype=torch.float64)
    before = float(param)
    optimizer.step()
    assert float(param) == before - optimizer.param_groups[0]["lr"]  # detached: plain steps
    assert math.isnan(scaler.applied_lr())


def test_a_factor_changed_during_the_step_applies_to_that_step():
    param, optimizer, _ = optimizer_and_scheduler()
    scaler = StepLRScaler()
    scaler.attach(optimizer)
    scaler.factor = 4.0

    def closure():  # Lightning runs the window's last micro-batch inside `optimizer.step`, after the pre-hook
        scaler.rescale(2.0)  # the step turned out to average half the samples planned
        param.grad = torch.ones(1, dtype=torch.float64)
        return torch.zeros(())

    optimizer.step(closure)
    assert float(param) == 1.0 - 0.1 * 2.0 and optimizer.param_groups[0]["lr"] == 0.1
