"""Optimizer and LR-scheduler wiring shared by the recipes' LightningModules."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

OptimizerFactory = Callable[..., torch.optim.Optimizer]  # Hydra `_partial_: true` optimizer
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]  # Hydra `_partial_: true` scheduler


def param_groups(module: nn.Module, decay_norm_and_bias: bool) -> list[dict[str, Any]]:
    """One group of all parameters, or two with weight decay off for biases and norm weights.

    Large-batch recipes (ImageNet, BERT with LAMB) exclude the 1-d parameters from weight decay;
    the paper's CIFAR code decays everything.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    if decay_norm_and_bias:
        return [{"params": params}]
    return [
        {"params": [p for p in params if p.ndim > 1]},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]


def configure(
    module: nn.Module,
    optimizer: OptimizerFactory,
    scheduler: SchedulerFactory | None,
    interval: str,
    decay_norm_and_bias: bool,
) -> Any:
    """What ``configure_optimizers`` returns: the optimizer and, if any, its scheduler."""
    opt = optimizer(param_groups(module, decay_norm_and_bias))
    if scheduler is None:
        return opt
    # Epoch-interval schedules (the CNN recipes') keep their meaning whatever the batch; a schedule over
    # the whole fit (recipes/schedules.py) takes its length in steps of B0 from the Trainer, and SimiGrad
    # advances step-interval schedules by the samples each step trains.
    if "total_steps" in inspect.signature(scheduler).parameters:
        schedule = scheduler(opt, total_steps=module.trainer.estimated_stepping_batches)  # type: ignore[attr-defined]
    else:
        schedule = scheduler(opt)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": interval}}
