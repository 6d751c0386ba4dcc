"""Optimizer and LR-scheduler wiring shared by the recipes' LightningModules."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
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


def shard_blocks(module: pl.LightningModule, blocks: Iterable[nn.Module]) -> None:
    """``configure_model`` of the language models: under Lightning's ``ModelParallelStrategy`` (``trainer=fsdp``),
    ``fully_shard`` every block, then the whole module (whatever is left forms the root's unit), over the data mesh;
    once. Every other strategy sees the unsharded module. FSDP2 gathers a unit's parameters around its ``forward``,
    so the modules' ``training_step`` and ``validation_step`` go through ``forward``."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = getattr(getattr(module, "_trainer", None), "strategy", None)
    if not isinstance(strategy, ModelParallelStrategy) or getattr(module, "fully_sharded", False):
        return
    from torch.distributed.fsdp import fully_shard

    assert module.device_mesh is not None  # the strategy sets it before configure_model
    mesh = module.device_mesh["data_parallel"]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    setattr(module, "fully_sharded", True)  # noqa: B010 -- read by configure_optimizers
