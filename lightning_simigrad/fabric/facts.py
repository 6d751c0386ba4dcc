"""What the Lightning-free run needs to know of a :class:`lightning.fabric.Fabric`, read where Fabric keeps it: the
data-parallel group, how the strategy trains (which picks the measurement, as under the Trainer), and the module a
measurement attaches to."""

from __future__ import annotations

from typing import Any

from lightning.fabric import Fabric
from lightning.fabric.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)

from lightning_simigrad.measurement.factory import Parallelism, Training

__all__ = ["data_parallel", "forward_module", "parallelism_of"]


def parallelism_of(fabric: Fabric) -> Parallelism:
    """How Fabric's strategy trains; a strategy SimiGrad cannot measure exactly is refused, with the fix."""
    strategy = fabric.strategy
    if isinstance(strategy, ModelParallelStrategy):
        return Parallelism(Training.FSDP2, fabric.world_size)
    if isinstance(strategy, FSDPStrategy):
        return Parallelism(Training.FSDP1, fabric.world_size)
    if isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)):
        return Parallelism(Training.SINGLE if fabric.world_size == 1 else Training.DDP, fabric.world_size)
    raise ValueError(
        f"SimiGrad under Fabric serves a single device, DDP (`strategy='ddp'`), FSDP (`strategy='fsdp'`) and"
        f" `ModelParallelStrategy` (FSDP2), not {type(strategy).__name__}: it must see every micro-batch's gradient"
        " where it accumulates. Choose one of those strategies."
    )


def data_parallel(fabric: Fabric) -> tuple[int, int]:
    """The number of data-parallel ranks and this process's rank among them (tensor-parallel ranks share samples)."""
    if isinstance(fabric.strategy, ModelParallelStrategy):
        kwargs = fabric.strategy.distributed_sampler_kwargs
        return int(kwargs["num_replicas"]), int(kwargs["rank"])
    return fabric.world_size, fabric.global_rank


def forward_module(model: Any) -> Any:
    """The module as the strategy wrapped it (DDP, FSDP1) or sharded it (FSDP2): what a measurement attaches to."""
    return getattr(model, "_forward_module", model)  # a `_FabricModule` keeps it there
