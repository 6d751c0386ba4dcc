"""FSDP2 variants of the test modules and a driver for Lightning fits under ``ModelParallelStrategy``.

Lightning's ``ModelParallelStrategy`` launches its processes with a subprocess script launcher unless they are
created externally: the tests start them with :func:`distributed.run_group` (which joins each to a gloo group)
and :func:`as_external_process` sets the environment Lightning's ``LightningEnvironment`` reads to treat them so.
FSDP2 (``fully_shard``) gathers a module's parameters only around that module's ``forward``, so every parameter
lives in a submodule that ``training_step`` calls.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad
from lightning_simigrad.testing import CPUFSDPStrategy, StepAudit
from tests.support.helpers import DIM, IndexedRegression, Regressor


def as_external_process(rank: int, world_size: int) -> None:
    """Lightning treats this process (started by ``run_group``) as one of ``world_size`` launched externally."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0")


def strategy(world_size: int, tensor_parallel_size: int = 1, **kwargs) -> ModelParallelStrategy:
    return ModelParallelStrategy(
        data_parallel_size=world_size // tensor_parallel_size,
        tensor_parallel_size=tensor_parallel_size,
        process_group_backend="gloo",
        **kwargs,
    )


def shard(module: nn.Module, parts: list[nn.Module]) -> None:
    """``fully_shard`` each of ``parts`` over the data-parallel mesh, then the root ``module``."""
    mesh = module.device_mesh["data_parallel"]
    for part in parts:
        fully_shard(part, mesh=mesh)
    fully_shard(module, mesh=mesh)


class FSDPRegressor(Regressor):
    """:class:`helpers.Regressor` with both linear layers and the module itself sharded (float64 throughout)."""

    def configure_model(self) -> None:
        if not hasattr(self, "fully_sharded"):
            self.fully_sharded = True
            shard(self, [self.net[0], self.net[-1]])


class PartlyShardedRegressor(Regressor):
    """A mistake: only the first layer sharded, the second layer's parameters left plain (and never reduced)."""

    def configure_model(self) -> None:
        if not hasattr(self, "fully_sharded"):
            self.fully_sharded = True
            fully_shard(self.net[0], mesh=self.device_mesh["data_parallel"])


class Dot(nn.Module):
    """``v . w``, its weight a vector (``fully_shard`` gives each rank a slice of it)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(dim))

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return v @ self.w


class LinearLayerLoss(pl.LightningModule):
    """:class:`helpers.LinearLoss` with its weight in a sharded submodule: the loss of sample ``v`` is ``w . v``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = Dot(DIM)

    def configure_model(self) -> None:
        if not hasattr(self, "fully_sharded"):
            self.fully_sharded = True
            shard(self, [self.layer])

    def training_step(self, batch, batch_idx):
        (v,) = batch
        return self.layer(v).mean()

    def configure_optimizers(self):
        # momentum: Lightning's sharded checkpoints want optimizer state; lr 0 (the gradients do not depend on w)
        return torch.optim.SGD(self.parameters(), lr=0.0, momentum=0.9)


def refusal(trainer: pl.Trainer, module: Regressor) -> tuple[str, int]:
    """The RuntimeError a short fit raised ("" for none) and the micro-batches it trained before."""
    try:
        trainer.fit(module, DataLoader(IndexedRegression(32), batch_size=4))
    except RuntimeError as error:
        return str(error), len(module.micro_batches)
    return "", len(module.micro_batches)


def fsdp1(world_size: int, **kwargs) -> CPUFSDPStrategy:
    """FSDP1 over ``world_size`` CPU processes (gloo), each ``nn.Linear`` its own unit."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kwargs.setdefault("auto_wrap_policy", ModuleWrapPolicy({nn.Linear}))
    return CPUFSDPStrategy(process_group_backend="gloo", **kwargs)


class RecordStatistics:
    """Wraps the measurement's ``collect`` to keep what it returns at every step: the halves' products."""

    def __init__(self, measurement) -> None:
        self.products: list[tuple[float, float, float] | None] = []
        collect = measurement.collect

        def recording(loss_scale):
            stats = collect(loss_scale)
            self.products.append((stats.dot, stats.sq_a, stats.sq_b) if stats is not None else None)
            return stats

        measurement.collect = recording  # type: ignore[method-assign]


class Recorder(StepAudit):
    """The step audit, and the measurement's own products of every step."""

    def on_train_start(self, trainer, pl_module):
        simigrad = next(c for c in trainer.callbacks if isinstance(c, SimiGrad))
        self.recorded = RecordStatistics(simigrad.run.measurement)
