"""The one place a measurement is chosen: from how the strategy trains, the composition that measures it.

=====================================  ===============================================  ===========================
training                               halves                                           rows cross ranks
=====================================  ===============================================  ===========================
one process                            in time, the first half moved aside              no
DDP                                    two groups of ranks, in DDP's communication hook   one all-gather
FSDP2 (``ModelParallelStrategy``)      in time, on each rank's gradient shards          one all-gather
FSDP1 (``FSDPStrategy``), even W       two groups of ranks, in a two-stage               one all-gather
                                       reduce-scatter
FSDP1, odd W                           in time, the gradient reduced at the midpoint     one all-gather
                                       too, the first half copied
DeepSpeed ZeRO 1 and 2                 in time, on each rank's partition of the reduced   one all-gather
                                       gradient, the midpoint an accumulation boundary
=====================================  ===============================================  ===========================

The integration describes the strategy as a :class:`Parallelism` (it is the only layer that knows Lightning);
a new measurement is a new row here and its halves, nothing else.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from lightning_simigrad.exchange import Rows
from lightning_simigrad.measurement.composed import ComposedMeasurement
from lightning_simigrad.measurement.protocol import Measurement
from lightning_simigrad.measurement.sharding import ShardedPieces, check_fsdp1_units, check_fsdp2
from lightning_simigrad.measurement.time_halves import CopyAside, LocalPieces, MoveAside, TimeHalves

__all__ = ["Parallelism", "Training", "measurement_for", "midpoint_reduction", "sharded_halves", "window_halves"]


class Training(enum.Enum):
    """How the strategy trains the model."""

    SINGLE = "single"  # one process
    DDP = "ddp"
    FSDP1 = "fsdp1"  # FSDPStrategy: accumulates inside no_sync, reduce-scatters at the window's end
    FSDP2 = "fsdp2"  # fully_shard under ModelParallelStrategy: reduces every micro-batch
    DEEPSPEED = "deepspeed"  # DeepSpeedStrategy at ZeRO stage 1 or 2: the engine reduces into its optimizer


@dataclass(frozen=True)
class Parallelism:
    """How a fit trains: the kind of training and the number of processes (all ranks, tensor-parallel included)."""

    training: Training
    world_size: int = 1


def measurement_for(parallelism: Parallelism) -> Measurement:
    """The measurement of a fit trained as ``parallelism`` says (call it on every rank: some make process groups)."""
    training = parallelism.training
    if training is Training.DEEPSPEED:
        from lightning_simigrad.measurement.zero_partitions import ZeroPartitions

        return ComposedMeasurement(ZeroPartitions(), Rows(what="DeepSpeed"), rank=_rank())
    if training is Training.FSDP2:
        return sharded_halves()
    if training is Training.FSDP1:
        if parallelism.world_size % 2 == 0:  # rank groups inside the reduce-scatter need partners
            from lightning_simigrad.measurement.reduce_scatter_groups import ReduceScatterGroups

            return ComposedMeasurement(ReduceScatterGroups(), Rows(what="FSDP"), rank=_rank())
        return midpoint_reduction()
    if training is Training.DDP:
        from lightning_simigrad.measurement.rank_groups import RankGroupMeasurement

        return RankGroupMeasurement()
    return window_halves()


def window_halves() -> ComposedMeasurement:
    """One process: the window's halves in time, the first half moved aside."""
    return ComposedMeasurement(TimeHalves("one-process", LocalPieces(), MoveAside()), Rows(collective=False))


def sharded_halves() -> ComposedMeasurement:
    """FSDP2: the window's halves in time on each rank's gradient shards, one all-gather of the rows."""
    halves = TimeHalves("FSDP", ShardedPieces(), MoveAside(), check=check_fsdp2)
    return ComposedMeasurement(halves, Rows(what="FSDP"), rank=_rank())


def midpoint_reduction() -> ComposedMeasurement:
    """FSDP1 on an odd number of ranks: the halves in time, the gradient reduced at the window's midpoint too."""
    halves = TimeHalves("FSDP", LocalPieces(), CopyAside(), check=check_fsdp1_units, midpoint_reduction=True)
    return ComposedMeasurement(halves, Rows(what="FSDP"), rank=_rank())


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
